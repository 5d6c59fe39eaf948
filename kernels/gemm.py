"""W4A16 GEMM in Triton: packed NVFP4 weights dequantized inside the kernel, then `tl.dot`.

Kernel for `minispec.quant.gemm.w4a16_matmul`, same signature: x [..., K] @ dequantize(w [N, K]).T.

One program computes a [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps. Each step loads
    x      [BLOCK_M, BLOCK_K]        in x's dtype
    codes  [BLOCK_N, BLOCK_K // 2]   uint8, two E2M1 codes per byte
    scales [BLOCK_N, BLOCK_K // 16]  uint8 E4M3 bit patterns
decodes both arithmetically (no fp8 types, so it runs in the interpreter and on any GPU), forms
w = q · s_b, and accumulates x @ wᵀ in float32. q · s_b is exact in bf16 and fp16 (q has 2 significant
bits, s_b 4; |q · s_b| is between 2**-10 and 6 · 448 = 2688), so w can go to the tensor cores in x's
16-bit dtype without any rounding. The per-tensor scale g multiplies the accumulator once at the end
(as Blackwell's block-scaled MMA leaves `alpha` to the epilogue). float32 x uses an IEEE float32 dot
(not TF32).

Tolerance against the reference (which computes x @ (q · (s_b · g))ᵀ in float32, rounded once):
both sums are float32 sums of the same K products in different orders, so each is within
γ = K · 2**-24 of the exact sum of |x| · |ŵ| (the standard bound), plus g's placement (2 more
roundings); the results are then rounded to x's dtype, where the two may land one unit in the last
place apart. tests/test_gemm.py checks |kernel - reference| <= 2·(K + 2)·2**-24 · (|x| @ |ŵ|ᵀ) + ulp.

The output is written in float32 and torch rounds it to x's dtype: the interpreter's float32 -> bf16
cast truncates. Under the interpreter bf16 operands are widened to float32 before `tl.dot` (exact; see
INTERPRETED below). `tl.dot_scaled` (FP4 tensor cores) is not used: it needs Blackwell, and the
interpreter decodes E4M3 scales there as E8M0 (MXFP4's scale format) and returns garbage.
"""
import torch
import triton
import triton.language as tl

from minispec.kernels.nvfp4 import _e2m1_value, _e4m3_value
from minispec.quant.gemm import check_w4a16_args
from minispec.quant.nvfp4 import NVFP4Tensor


@triton.jit
def _w4a16_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, out_ptr, M, N, K, stride_xm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N] rows of w
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=row_ok[:, None] & (k < K)[None, :], other=0.0)

        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(codes_ptr + cols[:, None] * (K // 2) + byte[None, :],
                         mask=col_ok[:, None] & (byte < K // 2)[None, :], other=0).to(tl.int32)
        q = tl.reshape(tl.join(_e2m1_value(packed & 15), _e2m1_value(packed >> 4)), [BLOCK_N, BLOCK_K])

        block = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        bits = tl.load(scales_ptr + cols[:, None] * (K // 16) + block[None, :],
                       mask=col_ok[:, None] & (block < K // 16)[None, :], other=0).to(tl.int32)
        w = tl.reshape(q, [BLOCK_N, BLOCK_K // 16, 16]) * _e4m3_value(bits)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(x_ptr.dtype.element_ty)  # exact: see the module docstring

        if UPCAST:  # the interpreter only: its tl.dot multiplies bf16 bit patterns (see INTERPRETED)
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    acc = acc * tl.load(g_ptr)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


# Triton 3.9's interpreter stores bfloat16 as uint16 and its tl.dot hands those integers to np.matmul,
# so a bf16 dot there returns garbage (~1e10). Under the interpreter bf16 operands are therefore widened
# to float32 first: exact, and the products and the float32 accumulation are the same as on a GPU.
INTERPRETED = not isinstance(_w4a16_kernel, triton.runtime.jit.JITFunction)


def block_sizes(M: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): tl.dot needs >= 16 each; small M (decoding) gets 16 rows."""
    return (min(64, max(16, triton.next_power_of_2(M))), 64, min(128, max(16, triton.next_power_of_2(K))))


def w4a16_matmul(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Same contract as the reference: x [..., K] @ dequantize(w [N, K]).T -> [..., N] in x's dtype."""
    check_w4a16_args(x, w)
    N, K = w.shape
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M:
        BLOCK_M, BLOCK_N, BLOCK_K = block_sizes(M, K)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _w4a16_kernel[grid](rows, w.codes.contiguous(), w.block_scales.contiguous().view(torch.uint8),
                            w.global_scale, out, M, N, K, rows.stride(0),
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                            PRECISION="ieee" if x.dtype == torch.float32 else None,
                            UPCAST=INTERPRETED and x.dtype == torch.bfloat16)
    return out.to(x.dtype).reshape(*x.shape[:-1], N)
