"""Numerics at the edges, kernels against references: NVFP4 on subnormal inputs, top-p over tiny tails.

NVFP4 quantize: a GPU converts bf16 and fp16 to float32 exactly, subnormals included, and the compiled
kernel flushes nothing to zero (checked below on the PTX for sm_90), so kernel and reference agree on
every input bit for bit: inputs below 2**-126 (float32 and bf16 subnormals), fp16 subnormals, blocks
whose amax is tiny beside blocks that are not.

Top-p: token i is kept iff the probabilities strictly above it sum to less than top_p. The oracle here
applies that rule in exact arithmetic (every float32 is an integer multiple of 2**-149, so its sums are
Python ints), and the probabilities themselves are checked against a float64 softmax. Rows with one
likely token and a long tail of tokens near 1e-7 are where float32 sums go wrong: each addition onto a
mass near 1 rounds by up to 6e-8.
"""
import math
import os
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from minispec.quant.nvfp4 import quantize
from minispec.speculative.sampling import sampling_probs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- NVFP4 quantize on subnormal and tiny inputs -----------------------------------------------------

def assert_same_nvfp4(a, b):
    assert torch.equal(a.codes.cpu(), b.codes.cpu()), f"{(a.codes != b.codes).sum()} code bytes differ"
    assert torch.equal(a.block_scales.view(torch.uint8).cpu(), b.block_scales.view(torch.uint8).cpu()), \
        "block scales differ"
    assert torch.equal(a.global_scale.cpu(), b.global_scale.cpu())


def smallest_16_bit_values(dtype: torch.dtype) -> torch.Tensor:
    """Every bf16 or fp16 value whose exponent field is 0 (the subnormals and ±0) or 1 (the smallest
    normals), both signs, in blocks of 16 consecutive bit patterns: [n_blocks, 16]."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    magnitudes = torch.arange(2 << mantissa_bits, dtype=torch.int32)
    patterns = torch.cat([magnitudes, magnitudes | 0x8000]).to(torch.int16)
    return patterns.view(dtype).reshape(-1, 16)


def tiny_float32_blocks() -> torch.Tensor:
    """[12, 16] float32: random subnormals (down to 2**-149), the largest subnormal and the smallest
    normal, each block with its own scale of tiny, and two ordinary blocks that set the tensor's amax."""
    g = torch.Generator().manual_seed(0)
    subnormal_bits = torch.randint(1, 1 << 23, (8, 16), generator=g, dtype=torch.int32)
    x = torch.cat([subnormal_bits.view(torch.float32),
                   torch.full((1, 16), 2.0**-126), torch.full((1, 16), (1 - 2.0**-23) * 2.0**-126),
                   torch.randn(2, 16, generator=g)])
    x[::2] = -x[::2]
    x[3, :8] = 0.0  # blocks of mixed zeros and subnormals
    return x


@pytest.mark.parametrize("four_over_six", [False, True], ids=["max6", "4over6"])
@pytest.mark.parametrize("global_scale", [None, 2.0**-120], ids=["auto", "g=2**-120"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_quantize_kernel_equals_reference_on_every_subnormal_16_bit_value(dtype, global_scale, four_over_six):
    x = smallest_16_bit_values(dtype).to(DEVICE)
    args = (x, four_over_six, global_scale)
    assert_same_nvfp4(quantize.kernel(*args), quantize.reference(*args))


@pytest.mark.parametrize("four_over_six", [False, True], ids=["max6", "4over6"])
@pytest.mark.parametrize("scale_of_x", [1.0, 2.0**-120], ids=["beside-normals", "all-tiny"])
def test_quantize_kernel_equals_reference_on_float32_subnormals_and_tiny_blocks(scale_of_x, four_over_six):
    # "all-tiny": the tensor's amax is ~1e-36, so g meets its floor 2**-126 and the block scales go subnormal.
    x = (tiny_float32_blocks() * scale_of_x).to(DEVICE)
    assert_same_nvfp4(quantize.kernel(x, four_over_six), quantize.reference(x, four_over_six))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fn", [quantize.kernel, quantize.reference], ids=["kernel", "reference"])
def test_a_block_of_1e_minus_39_quantizes_by_its_exact_value(fn, dtype):
    # 1e-39 is a subnormal in float32 and in bf16 (below 2**-126 ≈ 1.18e-38). The tensor's g,
    # 1e-39 / 2688, is below its floor 2**-126, so g = 2**-126 and the block scale is E4M3(a / (6 g))
    # = 7 · 2**-9 (bit pattern 7); every element is then 6 · 7 · 2**-9 · 2**-126 ≈ 9.64e-40.
    x = torch.full((1, 16), 1e-39, dtype=dtype, device=DEVICE)
    t = fn(x)
    assert t.global_scale.item() == 2.0**-126
    assert t.block_scales.view(torch.uint8).flatten().tolist() == [7]
    assert t.dequantize().flatten().tolist() == [6 * 7 * 2.0**-9 * 2.0**-126] * 16
    assert_same_nvfp4(t, quantize.reference(x.float()))  # bf16 -> float32 is exact, subnormals too


# --- top-p over tiny tails -------------------------------------------------------------------------

kernel, reference = sampling_probs.kernel, sampling_probs.reference


def exact_nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p rule in exact arithmetic: token i is kept iff the probabilities strictly larger than
    p_i sum to less than top_p. p: [rows, V] float32. Returns bool [rows, V].

    A float32 is an integer multiple of 2**-149, so these sums are Python ints and nothing rounds.
    """
    bound = Fraction(top_p) * 2**149
    kept = []
    for row in p.tolist():
        units = [int(v * 2.0**149) for v in row]  # exact: v is a float32, scaling by 2**149 is exact
        mass_above, total = {}, 0
        for unit, count in sorted(Counter(units).items(), reverse=True):
            mass_above[unit] = total
            total += unit * count
        kept.append([mass_above[u] < bound for u in units])
    return torch.tensor(kept)


def float64_softmax(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """Softmax in float64 over the top-k survivors of z = (logits - max logit) / temperature, z in float32
    as both implementations compute it."""
    x = logits.float()
    z = (x - x.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:], -math.inf)
    e = (z.double() - z.double().amax(dim=-1, keepdim=True)).exp()
    return e / e.sum(dim=-1, keepdim=True)


def tiny_tail_logits(seed: int, rows: int, V: int, top_p: float) -> torch.Tensor:
    """[rows, V] logits: one to three likely tokens and V - 3 tail tokens whose probabilities span two
    decades and sum to about 3 (1 - top_p), so top_p cuts in the middle of the tail (at temperature 1;
    multiply by T for temperature T). In every other row the tail logits are rounded to multiples of
    1/4, so that many tail tokens are exactly equally likely."""
    g = torch.Generator().manual_seed(seed)
    tail = 10 ** (2 * torch.rand(rows, V - 3, generator=g, dtype=torch.float64) - 1)
    tail = tail / tail.sum(dim=-1, keepdim=True) * 3 * (1 - top_p)
    head = torch.rand(rows, 3, generator=g, dtype=torch.float64) * (torch.rand(rows, 3, generator=g) < 0.7)
    head[:, 0] = 1.0
    head = head / head.sum(dim=-1, keepdim=True) * (1 - tail.sum(dim=-1, keepdim=True))
    logits = torch.cat([head, tail], dim=-1).log() + 3 * torch.randn(rows, 1, generator=g, dtype=torch.float64)
    logits[1::2, 3:] = (logits[1::2, 3:] * 4).round() / 4
    shuffle = torch.rand(rows, V, generator=g).argsort(dim=-1)
    return logits.gather(-1, shuffle).float()


def assert_top_p_is_exact(logits, temperature, top_k, top_p):
    """Both implementations: p within one float32 step of the float64 softmax (over the top-k
    survivors), kept set = the exact nucleus of their own p; and the two agree with each other."""
    logits = logits.to(DEVICE)
    want = float64_softmax(logits.cpu(), temperature, top_k)
    out = {}
    for name, fn in (("kernel", kernel), ("reference", reference)):
        p = fn(logits, temperature, top_k).cpu()
        torch.testing.assert_close(p.double(), want, rtol=2**-23, atol=0, msg=f"{name}: p is not the float64 softmax")
        out[name] = fn(logits, temperature, top_k, top_p).cpu()
        kept, exact = out[name] > 0, exact_nucleus(p, top_p)
        assert torch.equal(kept, exact), (
            f"{name} keeps {kept.sum(-1).tolist()} tokens per row, the exact rule {exact.sum(-1).tolist()}")
    assert torch.equal(out["kernel"] > 0, out["reference"] > 0)
    torch.testing.assert_close(out["kernel"], out["reference"], rtol=0, atol=1e-6)


def test_top_p_0_99999_over_a_tail_near_1e_minus_7_keeps_the_exact_nucleus():
    # One token of p ≈ 0.99955 and 2999 tokens between 1e-7 and 2e-7: top_p = 0.99999 cuts 98 of them.
    # A float32 softmax of this row (torch's on CPU) puts 0.999554 instead of 0.999550 on the first token,
    # which moves the cut by about 37 tail tokens.
    g = torch.Generator().manual_seed(0)
    tail = 1e-7 * (1 + torch.rand(2999, generator=g, dtype=torch.float64))
    logits = torch.cat([(1 - tail.sum()).reshape(1), tail]).log().float()[None]
    assert_top_p_is_exact(logits, 1.0, None, 0.99999)
    assert (kernel(logits.to(DEVICE), 1.0, None, 0.99999) > 0).sum().item() == 2902


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 0.99999), (0.5, None, 0.9999),
                                                      (1.0, 800, 0.999999), (2.0, None, 0.9999999)])
def test_top_p_keeps_the_exact_nucleus_on_seeded_tiny_tails(temperature, top_k, top_p):
    logits = tiny_tail_logits(len(str(top_p)), rows=6, V=1000, top_p=top_p) * temperature
    assert_top_p_is_exact(logits, temperature, top_k, top_p)


def test_top_p_equal_to_the_mass_above_a_token_drops_that_token():
    # 40 tokens between 1e-6 and 1: every partial sum of their float32 probabilities is exact in float64
    # (spans < 53 bits), so top_p can be set to exactly the mass above a token. The rule is strict
    # (mass above < top_p), so that token goes and the one just above it stays.
    g = torch.Generator().manual_seed(5)
    logits = (torch.rand(1, 40, generator=g) * -13.8).to(DEVICE)
    for fn in (kernel, reference):
        p = fn(logits, 1.0).cpu()[0].double()
        descending = p.sort(descending=True).values
        for rank in (1, 5, 20, 39):
            top_p = descending[:rank].sum().item()
            assert Fraction(top_p) == sum(Fraction(v) for v in descending[:rank].tolist())  # exact
            kept = (fn(logits, 1.0, None, top_p) > 0).sum().item()
            assert kept == rank, f"top_p = the mass of the {rank} most likely tokens kept {kept}"


# --- what a GPU compiles: no flush to zero ----------------------------------------------------------

COMPILE_FOR_H100 = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import minispec.kernels.nvfp4 as nvfp4
target = GPUTarget("cuda", 90, 32)
quantize = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8", "g_ptr": "*fp32", "n_blocks": "i32",
            "FOUR_OVER_SIX": "constexpr", "BLOCKS": "constexpr"}
dequantize = {"codes_ptr": "*u8", "scales_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*fp32", "n_blocks": "i32",
              "BLOCKS": "constexpr"}
four_over_six = {"FOUR_OVER_SIX": True, "BLOCKS": nvfp4.BLOCKS}
for fn, signature, constexprs, options in [
        (nvfp4._quantize_kernel, quantize, four_over_six, {"enable_fp_fusion": False}),
        (nvfp4._dequantize_kernel, dequantize, {"BLOCKS": nvfp4.BLOCKS}, {})]:
    ptx = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=target, options=options).asm["ptx"]
    print(fn.__name__, "flushes:", sorted(set(re.findall(r"\\b[a-z0-9]+(?:\\.[a-z0-9]+)*\\.ftz\\b[.a-z0-9]*", ptx))))
"""


@pytest.mark.slow
def test_compiled_nvfp4_kernels_do_not_flush_subnormals_to_zero():
    """The reference computes with IEEE subnormals (torch flushes none, on CPU or CUDA), so the kernels
    must not flush either: no PTX instruction with `.ftz` for sm_90 in bf16 quantize with four-over-six
    (which converts, divides, multiplies and adds float32) or in dequantize (whose x̂ can be subnormal)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no bundled ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["_quantize_kernel flushes: []", "_dequantize_kernel flushes: []"], out.stdout
