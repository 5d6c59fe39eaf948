"""NVFP4 quantize (with the four-over-six option) and dequantize in Triton.

Kernels for `minispec.quant.nvfp4.quantize` and `.dequantize`, with the same signatures. Codes and
block scales equal the reference's bit for bit; dequantized values too.

The tensor is seen as a flat run of 16-element blocks (K is a multiple of 16, so no block crosses a
row); one program owns BLOCKS blocks as a [BLOCKS, 16] tile. The per-tensor amax is one torch
reduction in the wrapper, as in Model Optimizer and torchao: a kernel only ever needs g.

What makes it bit-exact on every backend:
  - Rounding to E4M3 and to E2M1 is arithmetic (`_round_to_float_grid`): read the exponent from the
    float32 bits, build the power-of-two step from bits, round a / step to an integer with the
    float32 magic number 1.5 · 2**23 (ties to even), multiply back. Triton's `.to(tl.float8e4nv)` is
    never used: in the interpreter it drops the carry into the exponent and rounds ties away from zero
    (1.97 -> 1.0, 1.0625 -> 1.125; triton-lang/triton PRs #9808, #11897). E4M3 scales are stored and
    read as their uint8 bit patterns.
  - Divisions are `tl.math.div_rn` (correctly rounded, as torch divides), not `/`, which may compile to
    an approximate division on a GPU.
  - Four-over-six compares two sums of 16 squares; both are added in the reference's pairwise tree
    (split the tile's last axis in halves of pairs, add, repeat), and the launch turns off FMA fusion
    (`enable_fp_fusion=False`) so that x̂ - x and d·d round exactly as torch's separate ops do.
  - The dequantize kernel writes float32 and torch rounds to the caller's dtype: the interpreter's
    float32 -> bfloat16 cast truncates instead of rounding to nearest (checked with triton 3.9).
  - bfloat16 inputs are widened by their bits (`_load_as_float32`), exact for subnormals on every
    backend, and the compiled kernels hold no flush-to-zero (`.ftz`) instruction: tiny inputs give
    the reference's codes and scales too (tests/test_kernel_numerics.py).
"""
import torch
import triton
import triton.language as tl

from minispec.quant import nvfp4 as ref
from minispec.quant.nvfp4 import BLOCK_SIZE, NVFP4Tensor, check_quantize_input, resolve_global_scale

BLOCKS = 64  # 16-element blocks per program: a [64, 16] tile, 1024 elements
E4M3_MAX = tl.constexpr(ref.E4M3_MAX)
E4M3_MIN = tl.constexpr(ref.E4M3_MIN)


@triton.jit
def _round_to_float_grid(a, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Round float32 a >= 0 to the nearest value of a float format, ties to even.

    The step in a's binade is 2**(max(e, MIN_EXPONENT) - MANTISSA_BITS), with e = floor(log2 a) read
    from the float32 exponent field. a / step must stay below 2**22 (callers clamp a first).
    """
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)
    step = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((MANTISSA_BITS - exponent + 127) << 23).to(tl.float32, bitcast=True)
    v = a * inverse_step  # exact: a power-of-two factor
    v = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: float32 keeps no fraction there, so this is rint
    return v * step


@triton.jit
def _block_scale(block_amax, g, MAX_CODE: tl.constexpr):
    """E4M3(clamp(a_b / (MAX_CODE · g), 2**-9, 448)), as float32 [BLOCKS]."""
    ideal = tl.math.div_rn(block_amax, MAX_CODE * g)
    ideal = tl.minimum(tl.maximum(ideal, E4M3_MIN), E4M3_MAX)
    return tl.minimum(_round_to_float_grid(ideal, 3, -6), E4M3_MAX)


@triton.jit
def _e2m1_values(x, scale, g):
    """E2M1(clamp(x / (s_b · g), -6, 6)) for a [BLOCKS, 16] tile; the sign is kept, also on zero."""
    scaled = tl.math.div_rn(x, (scale * g)[:, None])
    magnitude = tl.minimum(tl.abs(scaled), 6.0)
    magnitude = _round_to_float_grid(magnitude, 1, 0)
    return tl.where(scaled.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude)


@triton.jit
def _e2m1_code(value):
    """E2M1 value -> 4-bit code (int32): sign << 3 | magnitude index. For |v| >= 1 the index is
    (exponent + 1) << 1 | mantissa bit, read from the float32 bits; below 1 it is 2|v| (0 or 1)."""
    bits = value.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    magnitude = tl.abs(value)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = (bits >> 22) & 1
    index = tl.where(magnitude < 1.0, (magnitude * 2.0).to(tl.int32), ((exponent + 1) << 1) | mantissa)
    return (sign << 3) | index


@triton.jit
def _e2m1_value(code):
    """4-bit code (int32) -> E2M1 value (float32); code 8 is -0.0."""
    index = code & 7
    exponent = index >> 1
    mantissa = index & 1
    normal = ((exponent + 126) << 23 | mantissa << 22).to(tl.float32, bitcast=True)  # 2**(e-1)·(1 + m/2)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e4m3_bits(scale):
    """E4M3 value (float32, >= 0, exactly representable) -> its uint8 bit pattern, as int32."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    normal = ((exponent + 7) << 3) | ((bits >> 20) & 7)
    subnormal = (scale * 512.0).to(tl.int32)  # multiples of 2**-9 below 2**-6
    return tl.where(exponent >= -6, normal, subnormal)


@triton.jit
def _e4m3_value(bits):
    """uint8 E4M3 bit pattern (as int32) -> float32: bit 7 sign, bits 6..3 exponent (bias 7), 2..0
    mantissa; exponent 0 is subnormal, m · 2**-9. (0x7F / 0xFF, NaN in E4M3, never come from quantize.)"""
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = ((exponent + 120) << 23 | mantissa << 20).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    return tl.where((bits & 128) != 0, -magnitude, magnitude)


@triton.jit
def _pairwise_sum16(squares, BLOCKS: tl.constexpr):
    """Σ over the 16 columns of a [BLOCKS, 16] tile in the reference's order ((0+1)+(2+3))+... ."""
    a, b = tl.split(tl.reshape(squares, [BLOCKS, 8, 2]))
    a, b = tl.split(tl.reshape(a + b, [BLOCKS, 4, 2]))
    a, b = tl.split(tl.reshape(a + b, [BLOCKS, 2, 2]))
    a, b = tl.split(a + b)
    return a + b


@triton.jit
def _block_squared_error(x, values, scale, g, BLOCKS: tl.constexpr):
    error = values * (scale * g)[:, None] - x
    return _pairwise_sum16(error * error, BLOCKS)


@triton.jit
def _load_as_float32(pointers, mask):
    """Load float32, float16 or bfloat16 values as float32, exactly (subnormals too).

    bfloat16 is the top half of a float32, so its bits shifted left by 16 are the float32 value. The
    interpreter's `.to(tl.float32)` mistranslates bf16 subnormals (below 2**-126: 1e-39 became 4.4e-39
    with triton 3.9); a GPU's cvt.f32.bf16 is exact, and so is this shift, on both.
    """
    x = tl.load(pointers, mask=mask, other=0.0)
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, n_blocks,
                     FOUR_OVER_SIX: tl.constexpr, BLOCKS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS]
    valid = block < n_blocks
    x = _load_as_float32(x_ptr + block[:, None] * 16 + tl.arange(0, 16)[None, :], valid[:, None])
    g = tl.load(g_ptr)

    block_amax = tl.max(tl.abs(x), axis=1)
    scale = _block_scale(block_amax, g, 6.0)
    values = _e2m1_values(x, scale, g)
    if FOUR_OVER_SIX:
        scale_4 = _block_scale(block_amax, g, 4.0)
        values_4 = _e2m1_values(x, scale_4, g)
        error_4 = _block_squared_error(x, values_4, scale_4, g, BLOCKS)
        use_4 = error_4 < _block_squared_error(x, values, scale, g, BLOCKS)  # strict: ties keep 6
        scale = tl.where(use_4, scale_4, scale)
        values = tl.where(use_4[:, None], values_4, values)

    low, high = tl.split(tl.reshape(_e2m1_code(values), [BLOCKS, 8, 2]))
    tl.store(codes_ptr + block[:, None] * 8 + tl.arange(0, 8)[None, :], (low | (high << 4)).to(tl.uint8),
             mask=valid[:, None])
    tl.store(scales_ptr + block, _e4m3_bits(scale).to(tl.uint8), mask=valid)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, g_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    valid = block < n_blocks
    packed = tl.load(codes_ptr + block[:, None] * 8 + tl.arange(0, 8)[None, :], mask=valid[:, None], other=0)
    packed = packed.to(tl.int32)
    values = tl.reshape(tl.join(_e2m1_value(packed & 15), _e2m1_value(packed >> 4)), [BLOCKS, 16])
    scale = _e4m3_value(tl.load(scales_ptr + block, mask=valid, other=0).to(tl.int32))
    out = values * (scale * tl.load(g_ptr))[:, None]
    tl.store(out_ptr + block[:, None] * 16 + tl.arange(0, 16)[None, :], out, mask=valid[:, None])


def quantize(x: torch.Tensor, four_over_six: bool = False, global_scale=None) -> NVFP4Tensor:
    """Same contract as the reference: x [..., K] -> NVFP4Tensor."""
    check_quantize_input(x)
    g = resolve_global_scale(x, four_over_six, global_scale)
    flat = x.contiguous().reshape(-1)
    n_blocks = flat.numel() // BLOCK_SIZE
    codes = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_blocks, dtype=torch.uint8, device=x.device)
    _quantize_kernel[(triton.cdiv(n_blocks, BLOCKS),)](flat, codes, scales, g, n_blocks,
                                                       FOUR_OVER_SIX=bool(four_over_six), BLOCKS=BLOCKS,
                                                       enable_fp_fusion=False)
    *lead, k = x.shape
    return NVFP4Tensor(codes.reshape(*lead, k // 2), scales.view(torch.float8_e4m3fn).reshape(*lead, k // BLOCK_SIZE),
                       g, x.shape)


def dequantize(codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as the reference: the fields of an NVFP4Tensor -> x̂ [..., K] in `dtype`."""
    *lead, half_k = codes.shape
    n_blocks = codes.numel() // (BLOCK_SIZE // 2)
    out = torch.empty(codes.numel() * 2, dtype=torch.float32, device=codes.device)
    _dequantize_kernel[(triton.cdiv(n_blocks, BLOCKS),)](
        codes.contiguous(), block_scales.contiguous().view(torch.uint8), global_scale.float().contiguous(), out,
        n_blocks, BLOCKS=BLOCKS)
    return out.reshape(*lead, 2 * half_k).to(dtype)
