"""`python -m minispec.bench replay`: Mamba state bytes (per-position vs checkpoint + replay) and
tokens/s of AR vs speculative decoding on lightning-mini with both strategies."""
from __future__ import annotations

import torch

from minispec import costs
from minispec.bench.timing import print_table, timed
from minispec.speculative.stats import SpecStats


def bytes_rows(ring: int = 16) -> list[dict]:
    """The byte model at T = 2, 4, 7 for Nemotron 3 Super and lightning-mini (per layer and sequence).

    Each step keeps T // 2 + 1 tokens (half the drafts accepted, plus the bonus token). Production
    numerics: fp32 state, bf16 records and conv window."""
    rows = []
    for name, shape in (("Super", costs.SUPER_MAMBA2), ("lightning-mini", costs.LIGHTNING_MINI_MAMBA2)):
        for T in (2, 4, 7):
            n = T // 2 + 1
            pp = costs.spec_state_traffic(shape, T, n, "per-position", capacity=ring)
            rp = costs.spec_state_traffic(shape, T, n, "replay", capacity=ring)
            rows.append({
                "shape": name, "T": T, "kept/step": n,
                "pp_write/tok_KiB": round(pp.written_per_token / 1024, 1),
                "rp_write/tok_KiB": round(rp.written_per_token / 1024, 1),
                "write_ratio": round(pp.written_per_token / rp.written_per_token, 2),
                "pp_read/tok_KiB": round(pp.read_per_token / 1024, 1),
                "rp_read/tok_KiB": round(rp.read_per_token / 1024, 1),
                "pp_mem_KiB": round(pp.memory_per_request / 1024, 1),
                "rp_mem_KiB": round(rp.memory_per_request / 1024, 1),
            })
    return rows


def speed_rows(prompts: int, max_new_tokens: int, drafters: list[str], K: int = 4, repeats: int = 2) -> list[dict]:
    """AR vs speculative on lightning-mini (batch 1, greedy), every strategy, on the frozen eval prompts.
    Each row is the best of `repeats` runs after a warm-up run (`minispec.bench.timing.timed`)."""
    import minispec as ms
    from minispec.ssm.hybrid import HybridLM

    model = HybridLM.from_pretrained("lightning-mini")
    chosen = ms.load_evalset().prompts[:prompts]
    rows = []
    for strategy in ("replay", "per-position"):
        model.spec_strategy = strategy
        ar_s, ar = timed(lambda: [ms.autoregressive_generate(model, p, max_new_tokens) for p in chosen], repeats)
        n_ar = sum(int(o.lengths.sum()) for o in ar)
        rows.append({"strategy": strategy, "method": "autoregressive", "drafter": "-", "tau": 1.0,
                     "tokens_per_s": round(n_ar / ar_s, 1), "speedup": 1.0, "equal_to_ar": True})
        for name in drafters:
            drafter = ms.load_drafter(name, model, num_draft_tokens=K)
            s, outs = timed(lambda drafter=drafter: [ms.speculative_generate(model, drafter, p[None], max_new_tokens)
                                                     for p in chosen], repeats)
            n = sum(int(o.lengths.sum()) for o in outs)
            stats = SpecStats([c for o in outs for c in o.stats.cycles])
            equal = all(torch.equal(o.tokens, a.tokens) for o, a in zip(outs, ar))
            rows.append({"strategy": strategy, "method": f"speculative K={K}", "drafter": name,
                         "tau": round(stats.tau, 3),
                         "tokens_per_s": round(n / s, 1), "speedup": round((n / s) / (n_ar / ar_s), 3),
                         "equal_to_ar": equal})
    model.spec_strategy = "replay"
    return rows


def bench_replay(args) -> list[dict]:
    table = bytes_rows()
    print("Mamba state bytes per layer and sequence (pp = per-position states, rp = checkpoint + replay, ring 16):")
    print_table(table)
    print()
    rows = [{"kind": "bytes", **r} for r in table]
    speed = speed_rows(args.prompts, args.max_new_tokens, args.drafters, repeats=args.repeats)
    rows += [{"kind": "speed", **r} for r in speed]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k, "") for k in keys} for r in rows]  # one column set, so the rows print as one table
