"""Benchmarks: `python -m minispec.bench ar [--json out.json]`.

Each benchmark runs its baseline and its subject side by side in one process, prints a table and
writes the same rows as JSON with a description of the machine. Tests never assert wall-clock
times; the numbers recorded in docs/benchmarks.md come from here.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import minispec as ms
from minispec.dflash.bench import bench_dflash
from minispec.kl_bench import bench_kl
from minispec.mtp.bench import bench_mtp
from minispec.quant.bench import bench_nvfp4
from minispec.ssm.bench import bench_replay


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def timed(fn, repeats: int) -> tuple[float, object]:
    """Best-of-`repeats` wall time of `fn()` after one warm-up call."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


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
        verifications = [c for o in outs for c in o.stats.verifications]
        tau = sum(c.accepted + 1 for c in verifications) / len(verifications)
        rows.append({"method": "speculative", "drafter": name, "K": drafter.num_draft_tokens, "tau": round(tau, 3),
                     "tokens_per_s": round(n / seconds, 1), "speedup": round((n / seconds) / (ar_n / ar_s), 3)})
    return rows


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))


BENCHES = {"ar": bench_ar, "spec": bench_spec, "kl": bench_kl, "dflash": bench_dflash, "replay": bench_replay,
           "mtp": bench_mtp, "nvfp4": bench_nvfp4}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec.bench")
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("--model", default="bolt-mini")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8, help="spec: how many eval prompts (batch 1 each)")
    p.add_argument("--drafters", nargs="+", default=["ngram", "bolt-nano"], help="spec: drafters to compare")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--drafter", default="bolt-mini-dflash", help="dflash: the drafter to measure")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="dflash: temperatures")
    p.add_argument("--eval-prompts", type=int, help="dflash: eval prompts for acceptance (default: all 241)")
    p.add_argument("--json", type=Path, help="where to write the rows (default bench-results/NAME.json)")
    args = p.parse_args(argv)
    rows = BENCHES[args.name](args)
    print_table(rows)
    out = args.json or Path("bench-results") / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": args.name, "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
