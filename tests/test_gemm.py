"""W4A16: x @ dequantize(w).T with NVFP4 weights; the Triton kernel against the reference.

The kernel's tolerance (kernels/gemm.py): the reference and the kernel are float32 sums of the same
K products x_k · ŵ_k in different orders (and the kernel applies g once at the end instead of to each
block scale), then each is rounded once to x's dtype. So, element by element,

    |kernel - reference| <= 2 · (K + 2) · 2**-24 · (|x| @ |ŵ|ᵀ)  +  ulp_dtype(|reference|)

the standard float32 summation bound, twice, plus one unit in the last place of the output dtype
(the two float32 results may sit on either side of a rounding boundary). No other slack.
"""
import pytest
import torch

from minispec.quant import nvfp4
from minispec.quant.gemm import w4a16_matmul
from minispec.quant.nvfp4 import NVFP4Tensor, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
reference, kernel = w4a16_matmul.reference, w4a16_matmul.kernel
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def tolerance(x: torch.Tensor, w: NVFP4Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The bound in the module docstring, per output element, as float64."""
    K = w.shape[1]
    w_hat = w.dequantize(torch.float32).double()
    magnitude = x.double().reshape(-1, K).abs() @ w_hat.abs().T
    r = ref.double().reshape(magnitude.shape).abs()
    ulp = torch.exp2(torch.floor(torch.log2(r.clamp(min=2**-100))) - MANTISSA_BITS[ref.dtype])
    return 2 * (K + 2) * 2**-24 * magnitude + ulp


def assert_within_tolerance(x, w, out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype == x.dtype
    error = (out.double() - ref.double()).reshape(-1, w.shape[0]).abs()
    bound = tolerance(x, w, ref)
    assert (error <= bound).all(), f"max error {error.max():.3g}, worst ratio {(error / bound).max():.3g}"


def weight(N: int, K: int, seed: int, four_over_six: bool = False) -> NVFP4Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :16] = 0.0  # an all-zero block (scale 2**-9)
    w[1, -1] = 3.0  # an outlier: the block scale 448
    return quantize(w.to(DEVICE), four_over_six=four_over_six)


# --- the reference -------------------------------------------------------------------------------------

def test_reference_is_x_times_dequantized_weight_transposed():
    w = weight(24, 64, 0)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = x.double() @ w.dequantize().double().T
    out = reference(x, w)
    assert out.shape == (3, 24) and out.dtype == torch.float32
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_reference_keeps_leading_dimensions_and_rounds_to_the_activation_dtype_once():
    w = weight(16, 32, 2)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for dtype in (torch.bfloat16, torch.float16):
        out = reference(x.to(dtype), w)
        assert out.shape == (2, 3, 16) and out.dtype == dtype
        assert torch.equal(out, (x.to(dtype).float() @ w.dequantize().T).to(dtype))


# --- bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [reference, kernel], ids=["reference", "kernel"])
def test_bad_input_raises_a_clear_error(fn):
    w = weight(16, 32, 4)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="last dimension must equal the weight's K"):
        fn(torch.randn(2, 48, device=DEVICE), w)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        fn(x.double(), w)
    with pytest.raises(ValueError, match="2-D weight"):
        fn(x, quantize(torch.randn(2, 16, 32, device=DEVICE)))
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        fn(x, torch.randn(16, 32, device=DEVICE))


# --- the kernel against the reference (interpreter on CPU) -----------------------------------------------

# K = 320 is two full 128-wide K steps and a masked 64-wide tail; N = 80 is one full and one masked
# 64-wide tile; M = 1 and 5 are decode sizes in one 16-row tile, 33 a partial 64-row tile, 70 two 64-row
# tiles, the second masked; K = 48 is one masked 64-wide step.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 16, 16), (5, 80, 320), (33, 48, 64), (70, 24, 48)], ids=str)
def test_kernel_equals_reference_within_tolerance(M, N, K, dtype):
    w = weight(N, K, 5)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    assert_within_tolerance(x, w, kernel(x, w), reference(x, w))


def test_kernel_with_four_over_six_weights_and_leading_dimensions():
    w = weight(40, 96, 7, four_over_six=True)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(DEVICE)
    out = kernel(x, w)
    assert out.shape == (2, 3, 40)
    assert_within_tolerance(x, w, out, reference(x, w))


def test_kernel_is_exact_when_every_sum_is_exact():
    # Small-integer activations and a power-of-two global scale: every product and partial sum is a
    # short dyadic number, so any summation order gives the exact result and the two must be equal.
    codes = torch.randint(0, 256, (32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    scales = torch.tensor([1.0, 2.0, 0.5, 4.0]).repeat(32, 1).to(torch.float8_e4m3fn)
    w = NVFP4Tensor(codes, scales, torch.tensor(2.0**-3), (32, 64)).to(DEVICE)
    x = torch.randint(-3, 4, (17, 64), generator=torch.Generator().manual_seed(10)).float().to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(kernel(x.to(dtype), w), reference(x.to(dtype), w))
    # x = I reads the dequantized weight back out of the kernel.
    eye = torch.eye(64, device=DEVICE)
    assert torch.equal(kernel(eye, w).T, nvfp4.dequantize.reference(w.codes, w.block_scales, w.global_scale))


def test_kernel_accepts_a_non_contiguous_activation_and_no_rows():
    w = weight(16, 64, 11)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(12)).to(DEVICE).T  # [6, 64], stride (1, 6)
    assert_within_tolerance(x, w, kernel(x, w), reference(x, w))
    assert kernel(torch.zeros(0, 64, device=DEVICE), w).shape == (0, 16)


def test_backend_triton_routes_w4a16_to_the_kernel(monkeypatch):
    monkeypatch.setenv("MINISPEC_BACKEND", "triton")
    w = weight(16, 32, 13)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(w4a16_matmul(x, w), kernel(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M", [1, 16, 64])
@pytest.mark.parametrize("N,K", [(2560, 8192), (8192, 2560)], ids=str)
def test_kernel_equals_reference_on_cuda_at_decode_shapes(M, N, K, dtype):
    g = torch.Generator("cuda").manual_seed(15)
    w = quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    assert_within_tolerance(x, w, kernel(x, w), reference(x, w))



def test_bench_nvfp4_runs_the_pytorch_rows_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("on CUDA this is the full benchmark, run by `python -m minispec.bench`")
    from types import SimpleNamespace

    from minispec.bench.nvfp4 import bench_nvfp4
    rows = bench_nvfp4(SimpleNamespace(repeats=1))
    assert {(r["op"], r["method"]) for r in rows} == {
        ("quantize", "torch reference"), ("w4a16", "torch dequantize+matmul"),
        ("w4a16", "bf16 matmul, unquantized"), ("w4a16", "torch reference (fp32)"), ("w4a4", "torch emulation (fp32)")}
    assert all(r["ms"] > 0 and r["note"] == "" for r in rows)
    assert all(list(r) == list(rows[0]) for r in rows)  # one set of columns for the table


def test_gemm_floors_put_w4a16_ahead_in_decoding_and_w4a4_in_prefill():
    from minispec.bench.nvfp4 import gemm_floor_rows

    rows = {(r["M"], r["gpu"], r["format"]): r for r in gemm_floor_rows(rows_of_x=(1, 4096))}
    # Decoding is memory-bound: 4.5 bits instead of 16 per weight, on either GPU, with or without FP4 MMA.
    assert rows[1, "H200", "w4a16"]["speedup_vs_bf16"] > 3.5 and rows[1, "H200", "w4a16"]["bound"] == "memory"
    assert rows[1, "B200", "w4a4"]["speedup_vs_bf16"] == rows[1, "B200", "w4a16"]["speedup_vs_bf16"]
    # Prefill is compute-bound: only FP4 tensor cores help, by their 4x peak over bf16.
    assert rows[4096, "H200", "w4a16"]["speedup_vs_bf16"] == 1.0
    assert rows[4096, "B200", "w4a4"]["speedup_vs_bf16"] == 4.0 and rows[4096, "B200", "w4a4"]["bound"] == "compute"
