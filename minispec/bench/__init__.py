"""Benchmarks: `python -m minispec.bench NAME [--json out.json]`.

Each benchmark runs its baseline and its subject side by side in one process, prints its rows as
tables (one per run of rows with the same columns) and writes them as JSON with a description of the
machine. One module per subject, all timed by `minispec.bench.timing.timed`. Tests never assert
wall-clock times; the numbers recorded in docs/benchmarks.md come from here.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from itertools import groupby
from pathlib import Path

import torch

from minispec.bench.decoding import bench_ar, bench_forward, bench_spec
from minispec.bench.dflash import DFLASH_DRAFTERS, bench_dflash
from minispec.bench.gpu import bench_gpu
from minispec.bench.kl import bench_kl
from minispec.bench.mtp import bench_mtp
from minispec.bench.nvfp4 import bench_nvfp4
from minispec.bench.replay import bench_replay
from minispec.bench.timing import print_table
from minispec.cli import positive_int, temperature
from minispec.dflash.drafter import POLICIES
from minispec.results import machine

BENCHES = {"ar": bench_ar, "spec": bench_spec, "forward": bench_forward, "kl": bench_kl, "dflash": bench_dflash,
           "replay": bench_replay, "mtp": bench_mtp, "nvfp4": bench_nvfp4, "gpu": bench_gpu}
# Options whose default depends on the benchmark; anything not listed defaults to DEFAULTS.
DEFAULTS = {"max_new_tokens": 64, "temperatures": [0.0, 1.0], "threads": None}
BENCH_DEFAULTS = {"dflash": {"max_new_tokens": 128, "temperatures": [0.0, 0.5, 1.0], "threads": 2}}


def draft_tokens(text: str) -> int | str:
    """A K for --draft-tokens: an integer >= 1, or "auto" (the cost model's pick)."""
    return text if text == "auto" else positive_int(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec.bench")
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("--target", default="bolt-mini",
                   help="ar, spec, dflash: the target, a shipped name, smollm2-135m or a local folder")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8])
    p.add_argument("--max-new-tokens", type=positive_int, help="default 64; dflash: 128")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's own; dflash: 2)")
    p.add_argument("--prompts", type=positive_int, default=8,
                   help="spec, dflash, mtp, replay: how many benchmark prompts are timed (batch 1 each)")
    p.add_argument("--drafters", nargs="+", default=["ngram", "bolt-nano"], help="spec: drafters to compare")
    p.add_argument("--temperature", type=temperature, default=0.0)
    p.add_argument("--drafter", help="dflash: the DFlash drafter (default: the target's shipped one, "
                                     f"{DFLASH_DRAFTERS})")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="dflash: the drafting policies to measure")
    # Either list may be given empty, so that the acceptance runs (which do not care what else the machine is
    # doing) and the wall-clock runs (which do) can be made at different times.
    p.add_argument("--temperatures", type=temperature, nargs="*",
                   help="dflash, mtp: temperatures of the acceptance runs (default 0 1; dflash: 0 0.5 1; "
                        "none: skip them)")
    p.add_argument("--timing-temperatures", type=temperature, nargs="*", default=[0.0],
                   help="dflash: temperatures of the batch-1 wall-clock runs (Hugging Face's rows: T = 0 only; "
                        "none: skip them)")
    p.add_argument("--draft-tokens", type=draft_tokens, nargs="+",
                   help="dflash: the K of DFlash's wall-clock rows, one row each (default: the drafter's own, its "
                        "block size - 1); a verify over K + 1 tokens costs more on a CPU than on a GPU. 'auto': "
                        "the K the cost model picks from held-out prompts (--tuning-prompts) and this machine's "
                        "timings")
    p.add_argument("--tuning-prompts", type=positive_int, default=32,
                   help="dflash: held-out prompts (never the benchmark's) the cost model picks K on")
    p.add_argument("--eval-prompts", type=positive_int,
                   help="dflash: prompts for acceptance (default: all, 241 eval prompts or MT-Bench's 80)")
    p.add_argument("--eval-batch", type=positive_int, default=16, help="dflash: batch size of the acceptance runs")
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 2, 4, 5, 8, 9, 16],
                   help="forward: new tokens per forward (a verify window is K + 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dflash, forward: the precision the target and every drafter compute in, the same for "
                        "every method of the run (bfloat16 runs SmolLM2 ~1.8x faster on a CPU with AVX-512 BF16)")
    p.add_argument("--dry-run", action="store_true", help="gpu: plan every row, shape and byte count without CUDA")
    p.add_argument("--json", type=Path, help="where to write the rows (default bench-results/NAME.json)")
    args = p.parse_args(argv)
    for key, value in {**DEFAULTS, **BENCH_DEFAULTS.get(args.name, {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = BENCHES[args.name](args)
    for _, table in groupby(rows, key=lambda row: tuple(row)):  # consecutive rows with the same columns
        print_table(list(table))
    out = args.json or Path("bench-results") / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m minispec.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps({"bench": args.name, "command": command, "machine": machine(),
                               "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"wrote {out}")
