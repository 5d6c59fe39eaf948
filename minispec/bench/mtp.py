"""`python -m minispec.bench mtp`: AR vs MTP speculative decoding on lightning-mini, in one run.

The head is the one shipped beside the backbone (`mtp_config.json` + `mtp.safetensors` in the
lightning-mini folder). Batch 1, the replay Mamba-state strategy, the frozen eval prompts. Per
temperature and K: tokens/s, τ (tokens per target forward, i.e. AL), the ratio to AR, the per-position
acceptance, and at T = 0 whether the output equals AR token for token. The AR baseline is greedy
plain decoding with the model's own cache at every temperature (its cost per token does not depend on
how the token is chosen).
"""
from __future__ import annotations

import torch

from minispec.bench.timing import timed
from minispec.mtp.drafter import MTPDrafter
from minispec.mtp.head import MTPHead
from minispec.speculative.stats import SpecStats

KS = (3, 7)


def speed_rows(model, head: MTPHead, prompts: list[torch.Tensor], max_new_tokens: int, ks=KS,
               temperatures=(0.0, 1.0), seed: int = 0) -> list[dict]:
    """AR and MTP speculative decoding of each prompt (batch 1) on a HybridLM `model`."""
    import minispec as ms

    ar_s, ar = timed(lambda: [ms.autoregressive_generate(model, p, max_new_tokens) for p in prompts], 1)
    n_ar = sum(int(a.lengths.sum()) for a in ar)
    rows = [{"method": "autoregressive", "T": "-", "K": 0, "tau": 1.0, "tokens_per_s": round(n_ar / ar_s, 1),
             "speedup": 1.0, "per_position": "-", "equal_to_ar": True}]
    for temperature in temperatures:
        for k in ks:
            drafter = MTPDrafter(head, model, num_draft_tokens=k)

            def spec():
                generator = torch.Generator().manual_seed(seed)
                return [ms.speculative_generate(model, drafter, p, max_new_tokens, temperature=temperature,
                                                generator=generator) for p in prompts]

            s, outs = timed(spec, 1)
            n = sum(int(o.lengths.sum()) for o in outs)
            stats = SpecStats([c for o in outs for c in o.stats.cycles])
            equal = (all(torch.equal(o.tokens, a.tokens) for o, a in zip(outs, ar))
                     if temperature == 0 else "-")
            rows.append({"method": "MTP speculative", "T": temperature, "K": k,
                         "tau": round(stats.tau, 3),
                         "tokens_per_s": round(n / s, 1), "speedup": round((n / s) / (n_ar / ar_s), 3),
                         "per_position": " ".join(f"{x:.2f}" for x in stats.per_position.tolist()),
                         "equal_to_ar": equal})
    return rows


def bench_mtp(args) -> list[dict]:
    import minispec as ms
    from minispec.ssm.hybrid import HybridLM

    model = HybridLM.from_pretrained("lightning-mini")
    head = MTPDrafter.beside(model).head
    prompts = ms.load_evalset().prompts[: args.prompts]
    return speed_rows(model, head, prompts, args.max_new_tokens, temperatures=tuple(args.temperatures))
