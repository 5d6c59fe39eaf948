"""DFlash against autoregressive decoding: acceptance on the frozen eval set, wall clock side by side,
and the cost model's prediction from the measured parts (`python -m minispec.bench dflash`).

The speedup formula of "Nemotron 3.5 Bolt E4B: block-parallel speculation with DFlash"
(`minispec.costs.speedup`): speedup = tau * C_t / (C_d + C_v), with C_t one plain
decode step, C_d the drafter's cost per cycle (one block forward + committing context) and C_v the
verify forward plus the loop's own overhead per cycle. Here each is measured in the same run that
measures the speedup, so a missed target can be attributed to tau, to C_d or to C_v.
"""
from __future__ import annotations

import time

import torch

import minispec as ms
from minispec import costs
from minispec.bench.timing import timed
from minispec.speculative import sampling as smp
from minispec.speculative.stats import SpecStats


class TimedDrafter:
    """A drafter wrapper that adds up the wall time spent inside the drafter (begin, propose, commit)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def _timed(self, method, *args):
        start = time.perf_counter()
        out = method(*args)
        self.seconds += time.perf_counter() - start
        return out

    def begin(self, *args):
        return self._timed(self.drafter.begin, *args)

    def propose(self, *args):
        return self._timed(self.drafter.propose, *args)

    def commit(self, *args):
        return self._timed(self.drafter.commit, *args)


def acceptance(target, drafter, prompts, max_new_tokens: int, temperature: float, batch_size: int = 16,
               seed: int = 0) -> SpecStats:
    """Speculative decoding over `prompts` in batches; the merged statistics of every cycle."""
    stats = SpecStats()
    generator = torch.Generator().manual_seed(seed)
    for i in range(0, len(prompts), batch_size):
        out = ms.speculative_generate(target, drafter, prompts[i: i + batch_size], max_new_tokens,
                                      temperature=temperature, generator=generator)
        stats.cycles.extend(out.stats.cycles)
    return stats


@torch.no_grad()
def argmax_ceiling(target, prompts, max_new_tokens: int, temperature: float, K: int = 7, starts: int = 4,
                   seed: int = 0) -> float:
    """The best tau any argmax drafter can reach here: it drafts the target's own greedy continuation.

    Along the target's own generation at `temperature`, from `starts` positions per prompt: the perfect
    argmax drafter proposes d_1 .. d_K = the target's greedy continuation, and one-hot rejection accepts
    d_k with probability p_T(d_k | context, d_<k), so E[tau] = 1 + sum_k prod_{j<=k} p_T(d_j). At T = 0
    this is K + 1; at T > 0 it is bounded by how peaked the target's distribution is, whatever the drafter.
    """
    generator = torch.Generator().manual_seed(seed)
    taus = []
    for prompt in prompts:
        prompt = torch.as_tensor(prompt)
        out = ms.autoregressive_generate(target, prompt, max_new_tokens, temperature=temperature,
                                         generator=generator)
        text = torch.cat([prompt, out.tokens[0, : int(out.lengths[0])]])
        for start in torch.linspace(len(prompt), len(text) - 1, starts).long().tolist():
            context = text[:start]
            drafts = ms.autoregressive_generate(target, context, K).tokens[0]
            logits = target(input_ids=torch.cat([context, drafts])[None]).logits[0, start - 1: start - 1 + len(drafts)]
            p = smp.sampling_probs(logits.float(), temperature).gather(-1, drafts[:, None]).squeeze(-1)
            taus.append(1.0 + float(p.cumprod(0).sum()))
    return sum(taus) / len(taus)


def side_by_side(target, drafter, prompts, max_new_tokens: int, temperature: float, seed: int = 0) -> dict:
    """Batch 1, prompt after prompt: AR, then speculative with the timed drafter; one row of numbers."""
    def ar(p):
        return ms.autoregressive_generate(target, p, max_new_tokens, temperature=temperature,
                                          generator=torch.Generator().manual_seed(seed))

    drafter = TimedDrafter(drafter)

    def spec(p):
        return ms.speculative_generate(target, drafter, p, max_new_tokens, temperature=temperature,
                                       generator=torch.Generator().manual_seed(seed))

    ar(prompts[0]), spec(prompts[0])  # warm-up on one prompt: the timed runs below are the whole set, once
    drafter.seconds = 0.0
    ar_seconds, ar_outs = timed(lambda: [ar(p) for p in prompts], 1, warmup=0)
    ar_tokens = sum(int(o.lengths.sum()) for o in ar_outs)
    spec_seconds, outs = timed(lambda: [spec(p) for p in prompts], 1, warmup=0)
    spec_tokens = sum(int(o.lengths.sum()) for o in outs)
    stats = SpecStats([c for o in outs for c in o.stats.cycles])
    tau, cycles = stats.tau, stats.verifications
    c_t = ar_seconds / ar_tokens  # one decode step (prefills included, as in the speculative run)
    c_d = drafter.seconds / len(cycles)
    c_v = (spec_seconds - drafter.seconds) / len(cycles)
    measured = (spec_tokens / spec_seconds) / (ar_tokens / ar_seconds)
    return {"temperature": temperature, "prompts": len(prompts), "tau": round(tau, 3),
            "ar_tokens_per_s": round(ar_tokens / ar_seconds, 1),
            "spec_tokens_per_s": round(spec_tokens / spec_seconds, 1), "speedup": round(measured, 3),
            "C_t_ms": round(1000 * c_t, 2), "C_d_ms": round(1000 * c_d, 2), "C_v_ms": round(1000 * c_v, 2),
            "predicted_speedup": round(costs.speedup(tau, c_t, c_d, c_v), 3),
            # At T = 0 the outputs must be the same tokens; at T > 0 they are equal in distribution only.
            "identical_to_ar": all(torch.equal(a.tokens, o.tokens) for a, o in zip(ar_outs, outs))
            if temperature == 0 else None}


def bench_dflash(args) -> list[dict]:
    """Rows per temperature: tau and per-position acceptance on the eval set, then batch-1 wall clock."""
    model, _ = ms.load_target(args.model)
    drafter = ms.load_drafter(args.drafter, model)
    prompts = ms.load_evalset().prompts
    chosen = prompts if args.eval_prompts is None else prompts[: args.eval_prompts]
    rows = []
    for temperature in args.temperatures:
        stats = acceptance(model, drafter, chosen, args.max_new_tokens, temperature)
        ceiling = argmax_ceiling(model, chosen[:: max(1, len(chosen) // 32)], args.max_new_tokens, temperature,
                                 K=drafter.num_draft_tokens)
        row = {"drafter": args.drafter, "eval_prompts": len(chosen), "temperature": temperature,
               "eval_tau": round(stats.tau, 3), "argmax_ceiling_tau": round(ceiling, 3)}
        row.update({f"acc_{k + 1}": round(float(a), 3) for k, a in enumerate(stats.per_position)})
        timing = side_by_side(model, drafter, prompts[: args.prompts], args.max_new_tokens, temperature)
        row.update({k: v for k, v in timing.items() if k != "temperature"})
        rows.append(row)
    return rows
