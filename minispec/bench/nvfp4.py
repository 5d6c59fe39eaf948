"""Benchmark rows for NVFP4: quantize, the W4A16 GEMM against dequantize-then-matmul, and the W4A4 GEMM.

`bench_nvfp4(args)` returns a list of dicts (one per op, shape and method) for `python -m minispec.bench`
to print and save. On CUDA it times decode shapes, M in {1, 16, 64} rows of activations against
weights [N, K] with K, N in {2560, 8192}, for:
    quantize:  the PyTorch reference, torch.compile of it, the Triton kernel (plain and four-over-six);
    w4a16:     the bf16 matmul with unquantized weights (what NVFP4 replaces), dequantize-then-matmul in
               PyTorch (dequantize to bf16 every call, then a bf16 matmul), torch.compile of that, and
               the Triton kernel that dequantizes inside the GEMM.
    w4a4:      the emulation (fake-quantize x, then the float32 reference) and the Triton kernel that
               quantizes x inside the GEMM, with the calibrated activation scale of x itself.
`speedup` is against the PyTorch row of the same op and shape. On a CPU only the PyTorch rows run, on
small shapes, so the function stays testable anywhere. Times are the best of `args.repeats` runs.
"""
from __future__ import annotations

from functools import partial

import torch

from minispec.bench.timing import timed
from minispec.quant.gemm import w4a4_matmul, w4a16_matmul
from minispec.quant.nvfp4 import dequantize, global_scale_from_amax, quantize


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
        base = add("quantize", "torch reference", "-", K, N, partial(quantize.reference, weight))
        if cuda:
            add("quantize", "torch.compile(reference)", "-", K, N, partial(compiled_quantize, weight), base)
            add("quantize", "triton", "-", K, N, partial(quantize.kernel, weight), base)
            base_46 = add("quantize 4/6", "torch reference", "-", K, N,
                          partial(quantize.reference, weight, four_over_six=True))
            add("quantize 4/6", "triton", "-", K, N, partial(quantize.kernel, weight, four_over_six=True), base_46)

        w = quantize.reference(weight)
        for M in rows_of_x:
            x = torch.randn(M, K, device=device, generator=generator).to(torch.bfloat16)
            fields = (w.codes, w.block_scales, w.global_scale)
            base = add("w4a16", "torch dequantize+matmul", M, K, N, partial(_dequantize_then_matmul, x, *fields))
            add("w4a16", "bf16 matmul, unquantized", M, K, N, partial(torch.matmul, x, weight.T), base)
            add("w4a16", "torch reference (fp32)", M, K, N, partial(w4a16_matmul.reference, x, w), base)
            if cuda:
                add("w4a16", "torch.compile(dequantize+matmul)", M, K, N, partial(compiled_matmul, x, *fields), base)
                add("w4a16", "triton", M, K, N, partial(w4a16_matmul.kernel, x, w), base)
            g_x = global_scale_from_amax(x.abs().amax().float())
            base = add("w4a4", "torch emulation (fp32)", M, K, N, partial(w4a4_matmul.reference, x, w, g_x))
            if cuda:
                add("w4a4", "triton", M, K, N, partial(w4a4_matmul.kernel, x, w, g_x), base)
    return rows


# Dense tensor-core peaks (FLOP/s) and memory bandwidth (bytes/s), NVIDIA's H200 and B200 data sheets.
# Hopper has no FP4 tensor cores.
PEAKS = {"H200": {"bf16": 989e12, "bandwidth": 4.8e12},
         "B200": {"bf16": 2.25e15, "fp4": 9e15, "bandwidth": 8.0e12}}
BYTES_PER_WEIGHT = {"bf16": 2.0, "w4a16": 0.5625, "w4a4": 0.5625}  # NVFP4: 4-bit code + an 8-bit scale per 16


def gemm_floor_rows(K: int = 8192, N: int = 8192, rows_of_x=(1, 16, 64, 256, 1024, 4096)) -> list[dict]:
    """The time one [M, K] x [K, N] GEMM needs at least, per format and GPU: max(bytes / bandwidth, FLOPs / peak).

    bf16 and W4A16 multiply on bf16 tensor cores (W4A16 decodes its weights to bf16 first); W4A4 on
    Blackwell's FP4 tensor cores, which Hopper does not have. Bytes: the weight once, x read (W4A4
    quantizes it on the fly) and y written, both bf16. A lower bound, no kernel reaches it; what it
    shows is which resource limits each M.
    """
    rows = []
    for M in rows_of_x:
        flops = 2 * M * K * N
        for gpu, fmt in (("H200", "bf16"), ("H200", "w4a16"), ("B200", "bf16"), ("B200", "w4a16"), ("B200", "w4a4")):
            peak = PEAKS[gpu]
            nbytes = N * K * BYTES_PER_WEIGHT[fmt] + M * K * 2 + M * N * 2
            compute = flops / peak["fp4" if fmt == "w4a4" else "bf16"]
            memory = nbytes / peak["bandwidth"]
            rows.append({"M": M, "gpu": gpu, "format": fmt, "MB": round(nbytes / 1e6, 2),
                         "floor_us": round(1e6 * max(compute, memory), 2),
                         "bound": "memory" if memory >= compute else "compute"})
    for row in rows:  # the speed-up over bf16 on the same GPU and M
        base = next(r for r in rows if (r["M"], r["gpu"], r["format"]) == (row["M"], row["gpu"], "bf16"))
        row["speedup_vs_bf16"] = round(base["floor_us"] / row["floor_us"], 2)
    return rows


def gemm_floor_figure(rows: list[dict], ax=None):
    """The speed-up floors of `gemm_floor_rows` against M (log scale): W4A16 wins where memory binds (decoding),
    W4A4 also where compute binds (prefill), and only on a GPU with FP4 tensor cores."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
        plt.close(fig)
    for gpu, fmt, style in (("H200", "w4a16", "o--"), ("B200", "w4a16", "o-"), ("B200", "w4a4", "s-")):
        chosen = [r for r in rows if (r["gpu"], r["format"]) == (gpu, fmt)]
        ax.plot([r["M"] for r in chosen], [r["speedup_vs_bf16"] for r in chosen], style, label=f"{fmt} on {gpu}")
    ax.axhline(1.0, color="black", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (rows of x: 1 = decoding one sequence, thousands = prefill)")
    ax.set_ylabel("floor speed-up over bf16")
    ax.legend(frameon=False, fontsize=8)
    ax.grid(alpha=0.3)
    return ax.figure
