"""Autoregressive and speculative decoding on a Hugging Face target: `python -m minispec.bench ar | spec`."""
from __future__ import annotations

import torch

import minispec as ms
from minispec.bench.timing import timed
from minispec.speculative.stats import SpecStats


def bench_ar(args) -> list[dict]:
    """Autoregressive tokens/s of a target at several batch sizes, on the frozen eval prompts."""
    model, _ = ms.load_target(args.model)
    prompts = ms.load_evalset().prompts
    rows = []
    for batch in args.batch:
        chosen = prompts[:batch]
        seconds, out = timed(lambda: ms.autoregressive_generate(model, chosen, args.max_new_tokens), args.repeats)
        n = int(out.lengths.sum())
        rows.append({"model": args.model, "batch": batch, "new_tokens": n, "seconds": round(seconds, 4),
                     "tokens_per_s": round(n / seconds, 1),
                     "ms_per_forward": round(1000 * seconds / int(out.lengths.max()), 2)})
    return rows


def bench_spec(args) -> list[dict]:
    """AR and speculative decoding with each drafter on the same prompts, batch 1, in one run."""
    model, _ = ms.load_target(args.model)
    prompts = ms.load_evalset().prompts[: args.prompts]

    def run_all(generate):
        outs = [generate(p) for p in prompts]
        return outs, sum(int(o.lengths.sum()) for o in outs)

    ar_s, (_, ar_n) = timed(lambda: run_all(lambda p: ms.autoregressive_generate(
        model, p, args.max_new_tokens, temperature=args.temperature, generator=torch.Generator().manual_seed(0))),
        args.repeats)
    rows = [{"method": "autoregressive", "drafter": "-", "K": 0, "tau": 1.0, "tokens_per_s": round(ar_n / ar_s, 1),
             "speedup": 1.0}]
    for name in args.drafters:
        drafter = ms.load_drafter(name, model)

        def spec(p):
            return ms.speculative_generate(model, drafter, p, args.max_new_tokens, temperature=args.temperature,
                                           generator=torch.Generator().manual_seed(0))

        seconds, (outs, n) = timed(lambda: run_all(spec), args.repeats)
        tau = SpecStats([c for o in outs for c in o.stats.cycles]).tau
        rows.append({"method": "speculative", "drafter": name, "K": drafter.num_draft_tokens, "tau": round(tau, 3),
                     "tokens_per_s": round(n / seconds, 1), "speedup": round((n / seconds) / (ar_n / ar_s), 3)})
    return rows
