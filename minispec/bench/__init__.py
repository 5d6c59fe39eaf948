"""Benchmarks: `python -m minispec.bench NAME [--json out.json]`.

Each benchmark runs its baseline and its subject side by side in one process, prints a table and
writes the same rows as JSON with a description of the machine. One module per subject, all timed by
`minispec.bench.timing.timed`. Tests never assert wall-clock times; the numbers recorded in
docs/benchmarks.md come from here.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from minispec.bench.decoding import bench_ar, bench_spec
from minispec.bench.dflash import bench_dflash
from minispec.bench.kl import bench_kl
from minispec.bench.mtp import bench_mtp
from minispec.bench.nvfp4 import bench_nvfp4
from minispec.bench.replay import bench_replay
from minispec.bench.timing import machine, print_table

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
    out.write_text(json.dumps({"bench": args.name, "machine": machine(),
                               "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"wrote {out}")

