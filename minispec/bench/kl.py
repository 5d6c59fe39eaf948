"""Benchmark rows for the forward KL: `python -m minispec.bench kl`.

`bench_kl(args)` times KL(teacher ‖ student) on bf16 logits, forward and forward + backward, for:
    torch reference             two float32 log-softmaxes over the whole vocabulary (minispec.kl)
    torch.compile(reference)    the same, fused by Inductor as it sees fit
    triton                      kernels/kl.py: vocabulary chunks with an online log-sum-exp
On CUDA: tokens in {4096, 16384, 32768} at V = 262,144 (Nemotron 3.5's vocabulary), with each method's
peak allocated memory above the inputs (logits and, for the backward, the gradient); a method that runs
out of memory gets a row saying so. On a CPU the reference and its torch.compile run, on a small
shape; the kernel does not (it would run in Triton's interpreter, which measures the interpreter).
Times are the best of `args.repeats` runs; `speedup` is against the reference's row.
"""
from __future__ import annotations

from functools import partial

import torch

from minispec.bench.timing import timed
from minispec.kl import kl_divergence

GIB = 2**30


def bench_kl(args) -> list[dict]:
    """KL forward / forward+backward timings and peak memory (see the module docstring)."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    repeats = int(getattr(args, "repeats", 3) or 3)
    shapes = [(n, 262_144) for n in (4096, 16384, 32768)] if cuda else [(64, 32_768)]
    methods = {"torch reference": kl_divergence.reference,
               "torch.compile(reference)": torch.compile(kl_divergence.reference, dynamic=False)}
    if cuda:
        methods["triton"] = kl_divergence.kernel
    generator = torch.Generator(device).manual_seed(0)
    rows = []
    for tokens, vocab in shapes:
        rows += _shape_rows(tokens, vocab, methods, generator, repeats, device)
    return rows


def _shape_rows(tokens: int, vocab: int, methods: dict, generator, repeats: int, device: str) -> list[dict]:
    """The rows of one [tokens, V] shape. Its logits are freed on return, before the next shape's."""
    cuda = device == "cuda"
    teacher = (torch.randn(tokens, vocab, device=device, generator=generator) * 3).to(torch.bfloat16)
    student = (torch.randn(tokens, vocab, device=device, generator=generator) * 3).to(torch.bfloat16)
    student.requires_grad_()

    def forward(fn):
        with torch.no_grad():
            return fn(teacher, student)

    def forward_backward(fn):
        student.grad = None
        fn(teacher, student).backward()

    rows, baseline = [], {}
    for op, run in (("forward", forward), ("forward+backward", forward_backward)):
        for method, fn in methods.items():
            row = {"op": op, "method": method, "tokens": tokens, "V": vocab}
            if cuda:
                student.grad = None
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base_bytes = torch.cuda.memory_allocated()
            try:
                ms = 1e3 * timed(partial(run, fn), repeats, warmup=2, cuda=cuda)[0]
            except torch.OutOfMemoryError:
                rows.append({**row, "ms": None, "speedup": None, "peak_extra_GiB": None, "note": "out of memory"})
                continue
            if method == "torch reference":
                baseline[op] = ms
            peak = (torch.cuda.max_memory_allocated() - base_bytes) / GIB if cuda else None
            speedup = round(baseline[op] / ms, 2) if op in baseline else None
            rows.append({**row, "ms": round(ms, 3), "speedup": speedup,
                         "peak_extra_GiB": None if peak is None else round(peak, 2), "note": ""})
    return rows
