"""Benchmark rows for NVFP4: quantize, and the W4A16 GEMM against dequantize-then-matmul.

`bench_nvfp4(args)` returns a list of dicts (one per op, shape and method) for `python -m minispec.bench`
to print and save. On CUDA it times decode shapes, M in {1, 16, 64} rows of activations against
weights [N, K] with K, N in {2560, 8192}, for:
    quantize:  the PyTorch reference, torch.compile of it, the Triton kernel (plain and four-over-six);
    w4a16:     the bf16 matmul with unquantized weights (what NVFP4 replaces), dequantize-then-matmul in
               PyTorch (dequantize to bf16 every call, then a bf16 matmul), torch.compile of that, and
               the Triton kernel that dequantizes inside the GEMM.
`speedup` is against the PyTorch row of the same op and shape. On a CPU only the PyTorch rows run, on
small shapes, so the function stays testable anywhere. Times are the best of `args.repeats` runs.
"""
from __future__ import annotations

import torch

from minispec.bench.timing import timed
from minispec.quant.gemm import w4a16_matmul
from minispec.quant.nvfp4 import dequantize, quantize


def _dequantize_then_matmul(x, codes, block_scales, global_scale):
    return x @ dequantize.reference(codes, block_scales, global_scale, x.dtype).T


def bench_nvfp4(args) -> list[dict]:
    """NVFP4 quantize and W4A16 GEMM timings (see the module docstring). Uses args.repeats (default 3)."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    repeats = int(getattr(args, "repeats", 3) or 3)
    inner = 20 if cuda else 1
    if cuda:
        rows_of_x, shapes = (1, 16, 64), [(K, N) for K in (2560, 8192) for N in (2560, 8192)]
    else:
        rows_of_x, shapes = (1, 16), [(256, 512)]
    compiled_matmul = torch.compile(_dequantize_then_matmul) if cuda else None
    compiled_quantize = torch.compile(quantize.reference) if cuda else None
    generator = torch.Generator(device).manual_seed(0)

    rows = []

    def add(op, method, M, K, N, fn, baseline_ms=None):
        try:
            ms = 1e3 * timed(fn, repeats, warmup=2, inner=inner, cuda=cuda)[0]
        except Exception as e:  # a method that cannot run on this machine gets a row that says why
            rows.append({"op": op, "method": method, "M": M, "K": K, "N": N, "ms": None,
                         "speedup": None, "note": f"{type(e).__name__}: {e}"[:120]})
            return None
        rows.append({"op": op, "method": method, "M": M, "K": K, "N": N, "ms": round(ms, 4),
                     "speedup": round(baseline_ms / ms, 2) if baseline_ms else 1.0, "note": ""})
        return ms

    for K, N in shapes:
        weight = (torch.randn(N, K, device=device, generator=generator) * 0.02).to(torch.bfloat16)
        base = add("quantize", "torch reference", "-", K, N, lambda: quantize.reference(weight))
        if cuda:
            add("quantize", "torch.compile(reference)", "-", K, N, lambda: compiled_quantize(weight), base)
            add("quantize", "triton", "-", K, N, lambda: quantize.kernel(weight), base)
            base_46 = add("quantize 4/6", "torch reference", "-", K, N,
                          lambda: quantize.reference(weight, four_over_six=True))
            add("quantize 4/6", "triton", "-", K, N, lambda: quantize.kernel(weight, four_over_six=True), base_46)

        w = quantize.reference(weight)
        for M in rows_of_x:
            x = torch.randn(M, K, device=device, generator=generator).to(torch.bfloat16)
            fields = (w.codes, w.block_scales, w.global_scale)
            base = add("w4a16", "torch dequantize+matmul", M, K, N, lambda: _dequantize_then_matmul(x, *fields))
            add("w4a16", "bf16 matmul, unquantized", M, K, N, lambda: x @ weight.T, base)
            add("w4a16", "torch reference (fp32)", M, K, N, lambda: w4a16_matmul.reference(x, w), base)
            if cuda:
                add("w4a16", "torch.compile(dequantize+matmul)", M, K, N, lambda: compiled_matmul(x, *fields), base)
                add("w4a16", "triton", M, K, N, lambda: w4a16_matmul.kernel(x, w), base)
    return rows
