"""The one timing helper of the benchmarks, and the table.

Every number in docs/benchmarks.md is a best-of-`repeats` wall time from `timed`: the best run is the
one least disturbed by the rest of the machine, and the warm-up runs pay for compilation, autotuning
and the allocator so no method is charged for them. On CUDA the clock is read only after the device
has finished (`torch.cuda.synchronize`), since kernel launches return before the work is done.
"""
from __future__ import annotations

import time

import torch


def timed(fn, repeats: int, *, warmup: int = 1, inner: int = 1, cuda: bool = False) -> tuple[float, object]:
    """(best seconds per call of `fn()`, its last output), after `warmup` untimed calls.

    Each of the `repeats` timed runs makes `inner` back-to-back calls and counts their mean, which
    lets calls far shorter than the clock's resolution (a GEMM at batch 1) be timed.
    """
    if repeats < 1 or inner < 1 or warmup < 0:
        raise ValueError(f"timed: repeats and inner must be >= 1 and warmup >= 0, got {repeats}, {inner}, {warmup}")
    out = None
    for _ in range(warmup):
        out = fn()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(inner):
            out = fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / inner)
    return best, out


def print_table(rows: list[dict]) -> None:
    """Rows of equal keys as right-aligned columns."""
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))
