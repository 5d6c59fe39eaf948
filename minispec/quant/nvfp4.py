"""NVFP4: 4-bit E2M1 values in blocks of 16, one FP8 E4M3 scale per block, one FP32 scale per tensor.

The format (NVIDIA Blackwell / OCP-style microscaling, as NVIDIA Model Optimizer's `NVFP4QTensor` writes it):

    x  [..., K]                        K a multiple of 16 (the block size); blocks run along the last dim
    g  = amax(|x|) / (6 · 448)         per-tensor *decode* scale, float32        ("weight_scale_2")
    s_b = E4M3( a_b / (6 · g) )        per-block scale, a_b = max |x| in block b ("weight_scale")
    q_i = E2M1( x_i / (s_b · g) )      element codes, ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}
    x̂_i = q_i · (s_b · g)              the dequantized value

E2M1(·) and E4M3(·) round to nearest, ties to even, and saturate (at ±6 and 448). The two codes of
elements 2j and 2j+1 share byte j: element 2j in the low nibble. g uses 448 so that the block holding
the tensor's max gets the largest block scale, 448.

Four-over-six ("Four Over Six: More Accurate NVFP4 Quantization with Adaptive Block Scaling", arXiv
2512.02010; reference code mit-han-lab/fouroversix): E2M1 is coarse near its top (4 → 6 is one step),
so mapping a block's max to 6 can cost a lot of error on the block's largest values. For each block,
also try mapping the max to 4 (block scale a_b / (4 · g)) and keep whichever reconstructs the block with the
smaller squared error (ties keep 6). The ×1.5 larger scale must still fit in E4M3, so g uses 256
instead of 448: g = amax / (6 · 256); the largest scale is then 1.5 · 256 = 384 ≤ 448. The result is
an ordinary NVFP4 tensor: nothing downstream knows which blocks chose 4.

Decisions where the public implementations (Model Optimizer, torchao, fouroversix, vLLM) disagree, all tested:
  - op order follows NVIDIA Model Optimizer's `NVFP4QTensor`: g = amax / 2688, s_b from a_b / (6 · g),
    codes from x / (s_b · g). torchao computes (a_b / 6) / g and x · ((1/g) / s_b): its block scales
    and codes differ from these by one step where the exact value is a tie (common with bf16 inputs).
    Four-over-six's "max → 4" scale is E4M3(a_b / (4 · g)); Model Optimizer reaches it as
    (1.5 · a_b / 6) · 256 / (amax / 6), which can only differ at an exact E4M3 tie (equal in the tests).
  - block scales are floored at 2**-9, the smallest positive E4M3 value (a subnormal): an all-zero
    block gets s_b = 2**-9 (never 0, so never 0/0 = NaN) and dequantizes to zeros; a tiny block keeps
    the most accurate scale E4M3 can hold. torchao floors at 2**-6 (the smallest *normal* value),
    which quantizes blocks whose scale lies in [2**-9, 2**-6) on a coarser grid than needed.
    Model Optimizer uses the same floor but stores 1.0 for an all-zero block.
  - g is floored at 2**-126 (the smallest normal float32) so s_b · g never underflows to 0: this
    covers the all-zero tensor, whose codes are then all 0.
  - tiny inputs are quantized from their exact values: bf16 and fp16 widen to float32 exactly, float32
    and bf16 subnormals (below 2**-126) included, and nothing is flushed to zero (torch flushes no
    subnormals, and the kernels compile to no flush-to-zero instruction). With the two floors, a tensor
    whose amax is below 2688 · 2**-126 ≈ 3.2e-35 gets g = 2**-126 and subnormal block scales: sixteen
    1e-39 give s_b = 7 · 2**-9 and x̂ = 9.64e-40. torchao, which does not floor g, keeps 1.01e-39 there.
  - the sign of zero is kept, as IEEE conversions and ml_dtypes keep it: -0.0 and tiny negatives that
    round to zero get code 8 (-0). Model Optimizer gives -0.0 (but not -0.1) code 0.
  - four-over-six adds each block's 16 squared errors in a fixed pairwise order, so the kernel makes the
    same choice even when the two errors differ only in their last bit.
  - elements are clamped to ±6 before rounding (only matters when the caller's global scale is too
    small for the tensor; then the block scale saturates at 448 and elements at ±6).
  - everything is computed in float32, whatever the input dtype: the scaled value is never rounded to
    bf16 before E2M1 rounding (that double rounding turns 2.500004 into 2 instead of 3: the bug that
    vllm-project/compressed-tensors PR #822 fixed).
Bad input is refused, never fixed silently: K not a multiple of 16 (pad it yourself), NaN/±inf.

The Triton kernels beside this reference (kernels/nvfp4.py) produce the same codes and block scales
bit for bit; `MINISPEC_BACKEND` picks between them (minispec/backend.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minispec.backend import dispatch

BLOCK_SIZE = 16  # elements per block, along the last dimension
E2M1_MAX = 6.0  # largest E2M1 magnitude
E4M3_MAX = 448.0  # largest finite E4M3 value
E4M3_MAX_FOUR_OVER_SIX = 256.0  # the "448" of the global scale when four-over-six is on
E4M3_MIN = 2.0**-9  # smallest positive E4M3 value (subnormal): the floor of every block scale
FP32_MIN_NORMAL = 2.0**-126  # the floor of the global scale

# The 16 E2M1 codes in order: bit 3 is the sign, bits 2..0 index the magnitudes. Code 8 is -0.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)

QUANTIZABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- the two small float formats -------------------------------------------------------------------

def _round_to_float_grid(a: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """Round a >= 0 to the nearest value of a float format, ties to even (no saturation here).

    A float format with `mantissa_bits` explicit mantissa bits and smallest normal exponent
    `min_exponent` spaces its values 2**(e - mantissa_bits) apart in each binade [2**e, 2**(e+1));
    below 2**min_exponent (the subnormals) the spacing stays 2**(min_exponent - mantissa_bits).
    Dividing by a power of two is exact, so rounding a / step to an integer, ties to even
    (torch.round), and multiplying back is exactly round-to-nearest-even.
    """
    exponent = torch.frexp(a).exponent - 1  # a in [2**exponent, 2**(exponent+1)); a = 0 gives -1
    exponent = exponent.clamp(min=min_exponent)
    step = torch.ldexp(torch.ones_like(a), exponent - mantissa_bits)
    return torch.round(a / step) * step


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round float32 x to the nearest E2M1 value, ties to even, saturating at ±6.

    x: any shape, float32. Returns float32 of the same shape, each value in ±{0, .5, 1, 1.5, 2, 3, 4, 6}.
    E2M1 has 1 mantissa bit and exponents 0..2 (bias 1), so the grid steps are 0.5 below 2, 1 in
    [2, 4), 2 in [4, 6]. The ties, |x| = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, go to the neighbour with
    an even mantissa: 0, 1, 1, 2, 2, 4, 4. Everything above 5 saturates to 6. The sign is kept, also on
    zero: -0.1 gives -0.0.
    """
    magnitude = _round_to_float_grid(x.abs().clamp(max=E2M1_MAX), mantissa_bits=1, min_exponent=0)
    return torch.copysign(magnitude, x)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round float32 x >= 0 to the nearest E4M3 (float8_e4m3fn) value, ties to even, saturating at 448.

    x: any shape, float32, >= 0 (block scales are non-negative). Returns float32 of the same shape whose
    values are exactly representable in torch.float8_e4m3fn. E4M3 has 3 mantissa bits, exponent bias
    7, smallest normal 2**-6 and subnormals down to 2**-9. Computed arithmetically (not by a cast) so
    that the rule is visible and so that it matches the kernel, which cannot trust Triton's cast (in the
    interpreter `.to(tl.float8e4nv)` drops the carry into the exponent, 126.7 -> 64: triton-lang/triton
    PR #11897).
    Saturating after rounding is the same as rounding the clamped value: 448..464 rounds to 448 anyway.
    """
    return _round_to_float_grid(x, mantissa_bits=3, min_exponent=-6).clamp(max=E4M3_MAX)


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """E2M1 values -> their 4-bit codes.

    values: any shape, float32, every element exactly one of the 16 E2M1 values (as e2m1_round
    returns). Returns uint8 of the same shape in 0..15: sign bit (set for -0.0 too) << 3 | index of the
    magnitude in E2M1_MAGNITUDES.
    """
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=values.device)
    index = torch.searchsorted(magnitudes, values.abs().contiguous())
    return (torch.signbit(values).to(torch.uint8) << 3) | index.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> E2M1 values. codes: uint8, any shape, 0..15. Returns float32 of the same shape."""
    return torch.tensor(E2M1_VALUES, device=codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: codes [..., K] uint8 (0..15), K even -> [..., K // 2] uint8.

    Byte j holds element 2j in its low nibble and element 2j+1 in its high nibble, as in Model
    Optimizer, torchao and Triton's block-scaled matmul tutorial.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: packed [..., K // 2] uint8 -> codes [..., K] uint8 (0..15)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


# --- the two scales --------------------------------------------------------------------------------

def global_scale_from_amax(amax: torch.Tensor | float, four_over_six: bool = False) -> torch.Tensor:
    """The per-tensor decode scale g = amax / (6 · 448), or amax / (6 · 256) with four-over-six.

    amax: the tensor's max |x| (weights: from the weight itself; activations: from calibration), a
    number or a tensor of them (one per tensor: [E] for E stacked expert matrices). Returns float32 of
    amax's shape, floored at 2**-126 so that an all-zero tensor (or one so tiny that the division
    underflows) still gets a usable scale.
    """
    fp8_max = E4M3_MAX_FOUR_OVER_SIX if four_over_six else E4M3_MAX
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return (amax / (E2M1_MAX * fp8_max)).clamp(min=FP32_MIN_NORMAL)


def block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor, max_code: float = E2M1_MAX) -> torch.Tensor:
    """E4M3 block scales that map each block's max |x| to `max_code` (6, or 4 for four-over-six).

    block_amax: [..., K // 16] float32, max |x| of each block. global_scale: float32 0-d tensor g.
    Returns float32 [..., K // 16]: s_b = E4M3(clamp(a_b / (max_code · g), 2**-9, 448)).
    """
    ideal = block_amax / (max_code * global_scale)
    return e4m3_round(ideal.clamp(min=E4M3_MIN, max=E4M3_MAX))


def quantize_blocks(blocks: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E2M1 values of each block under its scale: E2M1(clamp(x / (s_b · g), -6, 6)).

    blocks: [..., nb, 16] float32. scales: [..., nb] float32. Returns float32 [..., nb, 16] on the E2M1
    grid (the values, not yet the codes).
    """
    scaled = blocks / (scales * global_scale)[..., None]
    return e2m1_round(scaled.clamp(-E2M1_MAX, E2M1_MAX))


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x̂ = q · (s_b · g). values: [..., nb, 16] E2M1 values, scales: [..., nb]. Returns float32 [..., nb, 16]."""
    return values * (scales * global_scale)[..., None]


def block_squared_error(blocks: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Σ_i (x̂_i - x_i)² per block, when `blocks` [..., nb, 16] are quantized with `scales` [..., nb].

    Returns float32 [..., nb]. The 16 squares are added in a fixed pairwise tree ((0+1)+(2+3))+...,
    which the Triton kernel repeats exactly, so that both make the same four-over-six choice even when
    the two errors differ only in their last bit.
    """
    error = dequantize_blocks(quantize_blocks(blocks, scales, global_scale), scales, global_scale) - blocks
    squares = error * error
    while squares.shape[-1] > 1:
        squares = squares[..., 0::2] + squares[..., 1::2]
    return squares[..., 0]


def four_over_six_block_scales(blocks: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per block, the scale mapping its max to 6 or the one mapping it to 4, whichever errs less.

    blocks: [..., nb, 16] float32. global_scale: g, normally amax / (6 · 256). Returns float32 [..., nb]
    block scales (E4M3 values). The block keeps "max → 6" unless "max → 4" has strictly smaller squared
    error, as in mit-han-lab/fouroversix and Model Optimizer's MSE search over amax multipliers {1.0, 1.5}.
    """
    block_amax = blocks.abs().amax(dim=-1)
    scale_6 = block_scales(block_amax, global_scale, max_code=6.0)
    scale_4 = block_scales(block_amax, global_scale, max_code=4.0)
    use_4 = block_squared_error(blocks, scale_4, global_scale) < block_squared_error(blocks, scale_6, global_scale)
    return torch.where(use_4, scale_4, scale_6)


# --- the tensor ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor x [..., K] stored as NVFP4.

    codes:        uint8 [..., K // 2], two E2M1 codes per byte (element 2j in the low nibble)
    block_scales: float8_e4m3fn [..., K // 16], one per block of 16 along K ("weight_scale")
    global_scale: float32 0-d tensor g, the per-tensor decode scale ("weight_scale_2")
    shape:        torch.Size of x, (..., K)

    x̂ = E2M1(code) · block_scale · global_scale. 4.5 bits per element (4 + 8/16), plus 4 bytes.
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size

    def __post_init__(self):
        shape = torch.Size(self.shape)
        object.__setattr__(self, "shape", shape)
        if not shape or shape[-1] % BLOCK_SIZE:
            raise ValueError(f"NVFP4Tensor shape {tuple(shape)}: the last dimension must be a multiple of {BLOCK_SIZE}")
        *lead, k = shape
        expected = {"codes": (torch.uint8, (*lead, k // 2)),
                    "block_scales": (torch.float8_e4m3fn, (*lead, k // BLOCK_SIZE)),
                    "global_scale": (torch.float32, ())}
        for name, (dtype, want) in expected.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != want:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"NVFP4Tensor of shape {tuple(shape)} needs {name} {dtype} {want}, got {got}")
        if len({self.codes.device, self.block_scales.device, self.global_scale.device}) != 1:
            raise ValueError("NVFP4Tensor: codes, block_scales and global_scale must be on one device")

    def __repr__(self) -> str:
        return (f"NVFP4Tensor(shape={tuple(self.shape)}, global_scale={self.global_scale.item():.6g}, "
                f"device={self.device}, {self.nbytes} bytes)")

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes of storage: packed codes + block scales + the global scale."""
        return self.codes.numel() + self.block_scales.numel() + 4

    def to(self, device) -> NVFP4Tensor:
        return NVFP4Tensor(self.codes.to(device), self.block_scales.to(device), self.global_scale.to(device),
                           self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x̂ [..., K] in `dtype` (computed in float32, rounded to `dtype` once at the end)."""
        return dequantize(self.codes, self.block_scales, self.global_scale, dtype)


# --- checks ----------------------------------------------------------------------------------------

def check_quantize_input(x: torch.Tensor) -> None:
    """Raise ValueError unless x can be quantized: float32/float16/bfloat16, not empty, last dimension a
    multiple of 16, all values finite."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"NVFP4 quantize needs a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"NVFP4 quantize needs float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"NVFP4 quantize needs a non-empty tensor with at least one dimension, "
                         f"got shape {tuple(x.shape)}")
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 blocks are {BLOCK_SIZE} elements along the last dimension, but x has shape {tuple(x.shape)} "
            f"(last dimension {x.shape[-1]} is not a multiple of {BLOCK_SIZE}). minispec does not pad silently: "
            f"pad with zeros yourself, e.g. torch.nn.functional.pad(x, (0, {-x.shape[-1] % BLOCK_SIZE}))")
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise ValueError(f"cannot quantize non-finite values: x has {bad} NaN or ±inf entries (NVFP4 has no Inf/NaN)")


def check_global_scale(global_scale, device: torch.device) -> torch.Tensor:
    """A caller's global scale g as a float32 0-d tensor on `device`; ValueError unless finite and
    >= 2**-126 (a smaller g would let s_b · g underflow to 0)."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if g.numel() != 1:
        raise ValueError(f"global_scale must be one number, got shape {tuple(g.shape)}")
    g = g.reshape(())
    value = g.item()
    if not (math.isfinite(value) and value >= FP32_MIN_NORMAL):
        raise ValueError(f"global_scale must be finite and >= 2**-126 (a positive normal float32), got {value!r}")
    return g


def resolve_global_scale(x: torch.Tensor, four_over_six: bool, global_scale) -> torch.Tensor:
    """g for quantizing x: the caller's (checked) if given, else amax(|x|) / (6 · 448 or 6 · 256)."""
    if global_scale is not None:
        return check_global_scale(global_scale, x.device)
    return global_scale_from_amax(x.abs().amax().float(), four_over_six).to(x.device)


# --- quantize / dequantize (dispatched: Triton kernels in kernels/nvfp4.py) ------------------------

@dispatch("nvfp4:quantize")
def quantize(x: torch.Tensor, four_over_six: bool = False, global_scale=None) -> NVFP4Tensor:
    """x [..., K] (float32/float16/bfloat16, K a multiple of 16) -> NVFP4Tensor.

    four_over_six: choose per block between "max → 6" and "max → 4" (and default g to amax / (6·256)).
    global_scale: the decode scale g to use instead of amax(|x|) / (6·448) (e.g. from calibration);
    blocks whose scale would exceed 448 saturate.
    Subnormal inputs (below 2**-126) are quantized from their exact values, never flushed to zero; g is
    floored at 2**-126 and block scales at 2**-9 (see the module docstring).
    """
    check_quantize_input(x)
    g = resolve_global_scale(x, four_over_six, global_scale)
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    if four_over_six:
        scales = four_over_six_block_scales(blocks, g)
    else:
        scales = block_scales(blocks.abs().amax(dim=-1), g)
    codes = e2m1_encode(quantize_blocks(blocks, scales, g)).reshape(x.shape)
    return NVFP4Tensor(pack_nibbles(codes), scales.to(torch.float8_e4m3fn), g, x.shape)


@dispatch("nvfp4:dequantize")
def dequantize(codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fields of an NVFP4Tensor -> x̂ [..., K] in `dtype`.

    codes: uint8 [..., K // 2]; block_scales: float8_e4m3fn [..., K // 16]; global_scale: float32 0-d.
    Computed in float32 as q · (s_b · g), then rounded to `dtype` once.
    """
    values = e2m1_decode(unpack_nibbles(codes))
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK_SIZE)
    x_hat = dequantize_blocks(blocks, block_scales.float(), global_scale.float())
    return x_hat.reshape(values.shape).to(dtype)


def fake_quantize(x: torch.Tensor, four_over_six: bool = False, global_scale=None) -> torch.Tensor:
    """quantize then dequantize: x [..., K] -> x̂ [..., K] in x's dtype (no gradient rule here)."""
    return quantize(x, four_over_six=four_over_six, global_scale=global_scale).dequantize(x.dtype)
