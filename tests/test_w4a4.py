"""W4A4: NVFP4(x) @ dequantize(w).T, activations quantized on the fly; the Triton kernel against the emulation.

The reference is the W4A4 emulation (fake-quantize x with the calibrated g_x, then the float32 matmul).
The kernel quantizes x to the same codes and block scales, multiplies exact products q_x s_x · q_w s_w and
applies g_x · g_w once at the end (kernels/gemm.py). So, element by element, with x̂ = fake_quantize(x):

    |kernel - reference| <= 2 · (K + 2) · 2**-24 · (|x̂| @ |ŵ|ᵀ)  +  ulp_dtype(|reference|)

the W4A16 bound (tests/test_gemm.py) with x̂ in place of x, and equality where every sum is exact.
"""
import pytest
import torch

from minispec.quant.gemm import w4a4_matmul
from minispec.quant.nvfp4 import E2M1_MAGNITUDES, NVFP4Tensor, fake_quantize, global_scale_from_amax, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
reference, kernel = w4a4_matmul.reference, w4a4_matmul.kernel
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def weight(N: int, K: int, seed: int) -> NVFP4Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :16] = 0.0  # an all-zero block
    return quantize.reference(w.to(DEVICE))


def activations(M: int, K: int, seed: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with an all-zero block and an outlier, and its calibrated g_x = amax / (6 · 448)."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)) * 2
    x[0, :16] = 0.0
    x[-1, -1] = 40.0
    x = x.to(dtype).to(DEVICE)
    return x, global_scale_from_amax(x.abs().amax().float()).to(DEVICE)


def assert_within_tolerance(x, w, g_x, out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype == x.dtype
    K = w.shape[1]
    x_hat = fake_quantize(x.float(), global_scale=g_x).double().reshape(-1, K)
    magnitude = x_hat.abs() @ w.dequantize().double().abs().T
    r = ref.double().reshape(magnitude.shape).abs()
    ulp = torch.exp2(torch.floor(torch.log2(r.clamp(min=2**-100))) - MANTISSA_BITS[ref.dtype])
    error = (out.double() - ref.double()).reshape(magnitude.shape).abs()
    bound = 2 * (K + 2) * 2**-24 * magnitude + ulp
    assert (error <= bound).all(), f"max error {error.max():.3g}, worst ratio {(error / bound).max():.3g}"


def test_reference_is_the_emulation():
    w = weight(24, 64, 0)
    x, g_x = activations(3, 64, 1, torch.float32)
    expected = fake_quantize(x, global_scale=g_x).double() @ w.dequantize().double().T
    out = reference(x, w, g_x)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)
    x16 = x.to(torch.bfloat16)
    assert torch.equal(reference(x16, w, g_x),
                       (fake_quantize(x16.float(), global_scale=g_x) @ w.dequantize().T).to(torch.bfloat16))


# K = 160: a full 128-wide step and a masked 32-wide tail; N = 70: a full and a masked 64-wide tile;
# M = 1 a decode row, 17 a partial 32-row tile.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 16, 16), (17, 70, 160)], ids=str)
def test_kernel_equals_the_emulation_within_tolerance(M, N, K, dtype):
    w = weight(N, K, 2)
    x, g_x = activations(M, K, 3, dtype)
    assert_within_tolerance(x, w, g_x, kernel(x, w, g_x), reference(x, w, g_x))


def test_kernel_with_leading_dimensions_and_saturating_activations():
    # g_x calibrated on a smaller amax than this input: the largest blocks' scales saturate at 448.
    w = weight(32, 48, 4)
    x, g_x = activations(6, 48, 5, torch.bfloat16)
    x, g_x = x.reshape(2, 3, 48), g_x / 4
    out = kernel(x, w, g_x)
    assert out.shape == (2, 3, 32)
    assert_within_tolerance(x, w, g_x, out, reference(x, w, g_x))


def test_kernel_is_exact_when_every_sum_is_exact():
    # Both operands on the E2M1 grid with a 6 in every block and g = 2**-3: the block scales are 8, the
    # quantization is exact, every product is a multiple of 1/4 and every partial sum is short, so any
    # order of summation gives the exact result: kernel, emulation and the float64 product agree.
    g = torch.Generator().manual_seed(6)

    def on_grid(*shape):
        v = torch.tensor(E2M1_MAGNITUDES)[torch.randint(0, 8, shape, generator=g)]
        v = v * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
        v[..., ::16] = 6.0
        return v.to(DEVICE)

    x, w_full = on_grid(5, 48), on_grid(20, 48)
    scale = torch.tensor(2.0**-3, device=DEVICE)
    w = quantize.reference(w_full, global_scale=scale)
    for dtype in (torch.float32, torch.bfloat16):
        out = kernel(x.to(dtype), w, scale)
        assert torch.equal(out, reference(x.to(dtype), w, scale))
        assert torch.equal(out.double(), (x.double() @ w_full.double().T).to(dtype).double())


def test_kernel_accepts_a_non_contiguous_activation_and_no_rows():
    w = weight(16, 32, 7)
    x, g_x = activations(32, 5, 8, torch.float32)
    x = x.T  # [5, 32], stride (1, 5)
    assert_within_tolerance(x, w, g_x, kernel(x, w, g_x), reference(x, w, g_x))
    assert kernel(torch.zeros(0, 32, device=DEVICE), w, g_x).shape == (0, 16)


@pytest.mark.parametrize("fn", [reference, kernel], ids=["reference", "kernel"])
def test_bad_input_raises_a_clear_error(fn):
    w = weight(16, 32, 9)
    x = torch.randn(2, 32, device=DEVICE)
    g_x = torch.tensor(0.01, device=DEVICE)
    with pytest.raises(ValueError, match="input_scale .* as a tensor"):
        fn(x, w, 0.01)
    with pytest.raises(ValueError, match="float32 tensor of one element"):
        fn(x, w, torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="last dimension must equal the weight's K"):
        fn(torch.randn(2, 48, device=DEVICE), w, g_x)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        fn(x.double(), w, g_x)


def test_backend_triton_routes_w4a4_to_the_kernel_and_names_its_path(monkeypatch):
    from minispec.kernels.gemm import uses_block_scaled_dot

    monkeypatch.setenv("MINISPEC_BACKEND", "triton")
    w = weight(16, 32, 10)
    x, g_x = activations(4, 32, 11, torch.bfloat16)
    assert torch.equal(w4a4_matmul(x, w, g_x), kernel(x, w, g_x))
    assert uses_block_scaled_dot(x) is False  # CPU tensors: the portable path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M", [1, 64, 256])
@pytest.mark.parametrize("N,K", [(2560, 8192), (8192, 2560)], ids=str)
def test_kernel_equals_the_emulation_on_cuda(M, N, K, dtype):
    g = torch.Generator("cuda").manual_seed(12)
    w = quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    g_x = global_scale_from_amax(x.abs().amax().float())
    assert_within_tolerance(x, w, g_x, kernel(x, w, g_x), reference(x, w, g_x))
