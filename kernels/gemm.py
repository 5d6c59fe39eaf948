"""W4A16 and W4A4 GEMMs in Triton: packed NVFP4 weights decoded inside the kernel; for W4A4 the
activations quantized to NVFP4 inside it too.

Kernels for `minispec.quant.gemm.w4a16_matmul` (x [..., K] @ dequantize(w [N, K]).T) and
`w4a4_matmul` (the same with x quantized to NVFP4 first), same signatures.

W4A16
-----

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

W4A4
----
Each step of K quantizes the x tile [BLOCK_M, BLOCK_K] to NVFP4 with the helpers of kernels/nvfp4.py
(the same codes and block scales as `quantize`, bit for bit): per block of 16, s_x = E4M3(amax / (6 · g_x)),
q_x = E2M1(x / (s_x · g_x)). Then one of two paths, chosen by the wrapper (`uses_block_scaled_dot`):

- bfloat16 x on sm_100 (B200, compute capability 10.x): `_w4a4_block_scaled_kernel` packs q_x into
  E2M1 codes and s_x into E4M3 bits and hands both operands to `tl.dot_scaled(..., "e2m1", ..., "e2m1")`
  with their E4M3 scales per 16 elements, which triton 3.9 compiles to the FP4 tensor-core MMA
  (`tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`, checked in the PTX). Tiles 128 x 128 x 128.
- everything else (sm_80, sm_90, other devices, float32 / float16 x, the interpreter): `_w4a4_kernel`,
  the W4A16 kernel with the x tile replaced by q_x · s_x. Both q · s factors are exact in bfloat16 (as
  above), so the tensor cores multiply them exactly, in bf16 with a float32 accumulator.
  (`tl.dot_scaled` does not compile for sm_80: no E4M3 type there; on sm_90 it compiles to an
  emulation that upcasts to bf16, which is what this path does in the open.)
Both apply g_x · g_w once, to the float32 accumulator. Every product q_x s_x · q_w s_w is exact in
float32 (at most 12 significant bits), so the kernel and the reference differ only in the order of the
float32 sum and in where the two global scales are applied: where the sum is exact in any order and
the global scales are powers of two, the results are equal; otherwise within the W4A16 bound above,
with x̂ in place of x (tests/test_w4a4.py). The sm_100 path is compiled ahead of time here
(docs/kernels.md) but has not been run on a B200.
"""
import torch
import triton
import triton.language as tl

from minispec.kernels.nvfp4 import (
    _block_scale,
    _e2m1_code,
    _e2m1_value,
    _e2m1_values,
    _e4m3_bits,
    _e4m3_value,
    _load_as_float32,
)
from minispec.quant.gemm import check_w4a4_args, check_w4a16_args
from minispec.quant.nvfp4 import NVFP4Tensor


@triton.jit
def _weight_tile(codes_ptr, scales_ptr, cols, col_ok, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `cols` of the NVFP4 weight [N, K], columns k0 .. k0 + BLOCK_K, decoded: E2M1 code × its block's
    E4M3 scale, float32 [BLOCK_N, BLOCK_K] (the global scale is applied once, to the accumulator)."""
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(codes_ptr + cols[:, None] * (K // 2) + byte[None, :],
                     mask=col_ok[:, None] & (byte < K // 2)[None, :], other=0).to(tl.int32)
    q = tl.reshape(tl.join(_e2m1_value(packed & 15), _e2m1_value(packed >> 4)), [BLOCK_N, BLOCK_K])
    block = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    bits = tl.load(scales_ptr + cols[:, None] * (K // 16) + block[None, :],
                   mask=col_ok[:, None] & (block < K // 16)[None, :], other=0).to(tl.int32)
    return tl.reshape(tl.reshape(q, [BLOCK_N, BLOCK_K // 16, 16]) * _e4m3_value(bits)[:, :, None], [BLOCK_N, BLOCK_K])


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

        w = _weight_tile(codes_ptr, scales_ptr, cols, col_ok, k0, K, BLOCK_N, BLOCK_K)
        w = w.to(x_ptr.dtype.element_ty)  # exact: see the module docstring

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


@triton.jit
def _quantized_x_tile(x_ptr, rows, row_ok, k0, K, stride_xm, g_x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The x tile [BLOCK_M, BLOCK_K] at k0 as NVFP4: E2M1 values q [BLOCK_M * BLOCK_K // 16, 16] and
    E4M3 block scales s [BLOCK_M * BLOCK_K // 16] (float32), one row of q per block of 16."""
    k = k0 + tl.arange(0, BLOCK_K)
    x = _load_as_float32(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                         row_ok[:, None] & (k < K)[None, :])
    blocks = tl.reshape(x, [BLOCK_M * (BLOCK_K // 16), 16])
    s = _block_scale(tl.max(tl.abs(blocks), axis=1), g_x, 6.0)
    return _e2m1_values(blocks, s, g_x), s


@triton.jit
def _w4a4_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, g_x_ptr, out_ptr, M, N, K, stride_xm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N] rows of w
    row_ok, col_ok = rows < M, cols < N
    g_x = tl.load(g_x_ptr)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q_x, s_x = _quantized_x_tile(x_ptr, rows, row_ok, k0, K, stride_xm, g_x, BLOCK_M, BLOCK_K)
        x = tl.reshape(q_x * s_x[:, None], [BLOCK_M, BLOCK_K]).to(tl.bfloat16)  # exact: see the module docstring

        w = _weight_tile(codes_ptr, scales_ptr, cols, col_ok, k0, K, BLOCK_N, BLOCK_K).to(tl.bfloat16)

        if UPCAST:  # the interpreter only: its tl.dot multiplies bf16 bit patterns (see INTERPRETED)
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    acc = acc * (tl.load(g_x_ptr) * tl.load(g_ptr))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _w4a4_block_scaled_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, g_x_ptr, out_ptr, M, N, K, stride_xm,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok, col_ok = rows < M, cols < N
    g_x = tl.load(g_x_ptr)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q_x, s_x = _quantized_x_tile(x_ptr, rows, row_ok, k0, K, stride_xm, g_x, BLOCK_M, BLOCK_K)
        low, high = tl.split(tl.reshape(_e2m1_code(q_x), [BLOCK_M, BLOCK_K // 2, 2]))
        x_codes = (low | (high << 4)).to(tl.uint8)  # [BLOCK_M, BLOCK_K // 2], element 2j in the low nibble
        x_scales = tl.reshape(_e4m3_bits(s_x).to(tl.uint8), [BLOCK_M, BLOCK_K // 16]).to(tl.float8e4nv,
                                                                                           bitcast=True)
        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w_codes = tl.load(codes_ptr + cols[:, None] * (K // 2) + byte[None, :],
                          mask=col_ok[:, None] & (byte < K // 2)[None, :], other=0)  # [BLOCK_N, BLOCK_K // 2]
        block = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        w_scales = tl.load(scales_ptr + cols[:, None] * (K // 16) + block[None, :],
                           mask=col_ok[:, None] & (block < K // 16)[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        acc = tl.dot_scaled(x_codes, x_scales, "e2m1", tl.trans(w_codes), w_scales, "e2m1", acc)
    acc = acc * (tl.load(g_x_ptr) * tl.load(g_ptr))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def uses_block_scaled_dot(x: torch.Tensor) -> bool:
    """Whether `w4a4_matmul` takes the FP4 tensor-core path for x: bfloat16 activations (what a served model
    feeds its layers) on a CUDA device of compute capability 10.x (sm_100)."""
    return (not INTERPRETED and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] == 10)


def launch_w4a4(rows: torch.Tensor, w: NVFP4Tensor, input_scale: torch.Tensor, block_scaled: bool) -> torch.Tensor:
    """rows [M, K] (unit stride along K) -> y [M, N] float32, on the path `block_scaled` names.

    `w4a4_matmul` picks the path with `uses_block_scaled_dot`; tools/aot.py calls this directly to
    compile the sm_100 path on a machine that has no such device.
    """
    N, K = w.shape
    M = rows.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=rows.device)
    if not M:
        return out
    args = (rows, w.codes.contiguous(), w.block_scales.contiguous().view(torch.uint8), w.global_scale,
            input_scale.reshape(()).contiguous(), out, M, N, K, rows.stride(0))
    if block_scaled:
        grid = (triton.cdiv(M, 128), triton.cdiv(N, 128))
        _w4a4_block_scaled_kernel[grid](*args, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128)
    else:
        BLOCK_M, BLOCK_N, BLOCK_K = block_sizes(M, K)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _w4a4_kernel[grid](*args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST=INTERPRETED)
    return out


def w4a4_matmul(x: torch.Tensor, w: NVFP4Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Same contract as the reference: NVFP4(x; input_scale) [..., K] @ dequantize(w [N, K]).T -> [..., N]."""
    check_w4a4_args(x, w, input_scale)
    N, K = w.shape
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = launch_w4a4(rows, w, input_scale, uses_block_scaled_dot(x))
    return out.to(x.dtype).reshape(*x.shape[:-1], N)
