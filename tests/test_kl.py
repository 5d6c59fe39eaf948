"""minispec.kl: the forward-KL reference, and the chunked Triton kernel against it (interpreter on CPU).

Tolerances, kernel vs reference (both compute in float32, but sum in different orders):
    values:                  |Δ| <= 1e-5 + 1e-5 · |KL|
    float32 gradients:       |Δ| <= 1e-8 + 1e-5 · |grad|
    bfloat16 gradients:      one bfloat16 ulp (rtol 2^-8): both round a float32 gradient to nearest-even,
                             and float32 values that differ in their last bits can round apart.
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minispec import kl

fused_kl = pytest.importorskip("minispec.kernels.kl")

V = 300  # not a multiple of the 64-wide chunks used below: the last chunk is ragged
BLOCK_V = 64


def logits(shape, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def run(fn, teacher, student, temperature, reduction, **kw):
    """Value and student gradient of fn under a random upstream gradient (fixed seed)."""
    s = student.clone().requires_grad_()
    out = fn(teacher, s, temperature, reduction, **kw)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(upstream)
    return out.detach(), s.grad


@pytest.mark.parametrize("dtype,reduction,temperature", [
    (torch.float32, "mean", 1.0), (torch.float32, "none", 0.5),
    (torch.bfloat16, "mean", 2.0), (torch.bfloat16, "none", 1.0),
])
def test_kernel_equals_reference(dtype, reduction, temperature):
    teacher, student = logits((2, 3, V), dtype, 0), logits((2, 3, V), dtype, 1)
    want, want_grad = run(kl.kl_divergence.reference, teacher, student, temperature, reduction)
    got, got_grad = run(fused_kl.kl_divergence, teacher, student, temperature, reduction, block_v=BLOCK_V)
    assert got.dtype == torch.float32 and got.shape == want.shape == ((2, 3) if reduction == "none" else ())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_grad.dtype == dtype and got_grad.shape == student.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got_grad, want_grad, atol=1e-8, rtol=1e-5)
    else:
        torch.testing.assert_close(got_grad.float(), want_grad.float(), atol=1e-12, rtol=2**-8)
    assert want_grad.abs().max() > 1e-3  # the gradients compared are not all ~0


def test_default_chunk_and_one_row():
    teacher, student = logits((1, V), torch.float32, 2), logits((1, V), torch.float32, 3)
    want, want_grad = run(kl.kl_divergence.reference, teacher, student, 1.3, "mean")
    got, got_grad = run(fused_kl.kl_divergence, teacher, student, 1.3, "mean")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-8, rtol=1e-5)


def test_full_vocabulary_row_against_float64():
    """V = 262,144 in 64 chunks of the default width: the streamed sums stay accurate. (The kernel is
    closer to float64 than the reference here: |Δ| = 4e-8 vs 7e-4 for the reference's two full
    float32 log-softmaxes on CPU, measured, at KL = 15.1.)"""
    teacher = logits((1, 262_144), torch.bfloat16, 20, scale=4.0)
    student = logits((1, 262_144), torch.bfloat16, 21, scale=4.0)
    log_p_t, log_p_s = torch.log_softmax(teacher.double(), -1), torch.log_softmax(student.double(), -1)
    exact = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)
    got = fused_kl.kl_divergence(teacher, student, reduction="none")
    assert abs(got.item() - exact.item()) < 1e-6 * exact.item()
    assert abs(kl.kl_divergence.reference(teacher, student).item() - exact.item()) < 2e-4 * exact.item()


@pytest.mark.parametrize("fn", [kl.kl_divergence.reference,
                                lambda t, s, T=1.0, r="mean": fused_kl.kl_divergence(t, s, T, r, block_v=2)],
                         ids=["reference", "kernel"])
def test_known_value_and_gradient(fn):
    # p_t = (1/2, 1/2), p_s = (3/4, 1/4): KL = ½ log(½ / ¾) + ½ log(½ / ¼) = ½ log(4/3).
    teacher = torch.tensor([[0.0, 0.0]])
    student = torch.tensor([[math.log(3.0), 0.0]], requires_grad=True)
    out = fn(teacher, student)
    assert out.item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-6)
    out.backward()
    torch.testing.assert_close(student.grad, torch.tensor([[0.25, -0.25]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("fn", [kl.kl_divergence.reference,
                                lambda t, s, T, r: fused_kl.kl_divergence(t, s, T, r, block_v=BLOCK_V)],
                         ids=["reference", "kernel"])
def test_same_distribution_is_zero_and_shift_invariant(fn):
    teacher, student = logits((3, V), torch.float32, 4), logits((3, V), torch.float32, 5)
    assert fn(teacher, teacher + 17.0, 1.0, "none").abs().max() < 1e-5
    # Softmax ignores a per-row shift; large offsets must not overflow the online log-sum-exp.
    base = fn(teacher, student, 1.5, "none")
    shifted = fn(teacher + 1e4, student - 5e3, 1.5, "none")
    torch.testing.assert_close(shifted, base, atol=2e-3, rtol=0)
    assert base.min() > 0.1


def test_reference_gradient_is_softmax_difference():
    teacher, student = logits((4, 50), torch.float64, 6), logits((4, 50), torch.float64, 8)
    temperature = 0.7
    student.requires_grad_()
    kl.kl_divergence.reference(teacher, student, temperature).backward()
    grad = student.grad
    want = (torch.softmax(student / temperature, -1) - torch.softmax(teacher / temperature, -1)) / temperature / 4
    torch.testing.assert_close(grad, want, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("fn", [kl.kl_divergence.reference,
                                lambda t, s: fused_kl.kl_divergence(t, s, block_v=BLOCK_V)],
                         ids=["reference", "kernel"])
def test_teacher_gets_no_gradient(fn):
    teacher = logits((2, V), torch.float32, 9).requires_grad_()
    student = logits((2, V), torch.float32, 10).requires_grad_()
    fn(teacher, student).backward()
    assert teacher.grad is None and student.grad is not None


def test_empty_rows_with_reduction_none():
    empty = torch.zeros(0, V)
    assert fused_kl.kl_divergence(empty, empty, reduction="none").shape == (0,)
    assert kl.kl_divergence.reference(empty, empty, reduction="none").shape == (0,)


class _RecordFloat32(TorchDispatchMode):
    """The largest float32/float64 tensor any op produced while active (numel)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dtype in (torch.float32, torch.float64):
                self.largest = max(self.largest, o.numel())
        return out


def _largest_float32_in_forward_and_backward(fn):
    teacher = logits((4, V), torch.bfloat16, 11)
    student = logits((4, V), torch.bfloat16, 12).requires_grad_()
    with _RecordFloat32() as rec:
        fn(teacher, student).backward()
    return rec.largest


def test_kernel_makes_no_vocabulary_sized_float32_tensor():
    # bf16 logits in, bf16 gradient out: the only float32 tensors are per-row (KL, two log-sum-exps).
    assert _largest_float32_in_forward_and_backward(
        lambda t, s: fused_kl.kl_divergence(t, s, block_v=BLOCK_V)) < V
    # The same probe catches the reference's full float32 softmaxes, so it can fail.
    assert _largest_float32_in_forward_and_backward(kl.kl_divergence.reference) >= 4 * V


def test_dispatch_picks_the_kernel_when_asked(monkeypatch):
    teacher, student = logits((2, V), torch.float32, 13), logits((2, V), torch.float32, 14)
    monkeypatch.setenv("MINISPEC_BACKEND", "triton")
    called = []
    real = fused_kl._FusedKL.apply
    monkeypatch.setattr(fused_kl._FusedKL, "apply", lambda *a: called.append(1) or real(*a))
    got = kl.kl_divergence(teacher, student)
    assert called and got.item() == pytest.approx(kl.kl_divergence.reference(teacher, student).item(), abs=1e-5)


BAD_INPUTS = [
    (torch.zeros(2, 5), torch.zeros(2, 6), {}, "same shape"),
    (torch.zeros(2, 5), torch.zeros(3, 5), {}, "same shape"),
    (torch.zeros(2, 5), torch.zeros(2, 5), {"temperature": 0.0}, "temperature"),
    (torch.zeros(2, 5), torch.zeros(2, 5), {"temperature": -1.0}, "temperature"),
    (torch.zeros(2, 5), torch.zeros(2, 5), {"temperature": float("nan")}, "temperature"),
    (torch.zeros(2, 5), torch.zeros(2, 5), {"reduction": "sum"}, "reduction"),
    (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5), {}, "teacher_logits must be float"),
    (torch.zeros(2, 0), torch.zeros(2, 0), {}, "V >= 1"),
    (torch.tensor([[0.0, float("nan"), 1.0]]), torch.zeros(1, 3), {}, "teacher_logits contains NaN"),
    (torch.zeros(1, 3), torch.tensor([[0.0, float("inf"), 1.0]]), {}, "student_logits contains NaN or ±inf"),
    (torch.zeros(1, 3), torch.tensor([[0.0, 1.0, -float("inf")]]), {}, "student_logits contains"),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy, on NaN
@pytest.mark.parametrize("teacher,student,kw,message", BAD_INPUTS)
@pytest.mark.parametrize("fn", [kl.kl_divergence.reference, fused_kl.kl_divergence], ids=["reference", "kernel"])
def test_bad_input_is_a_clear_error(fn, teacher, student, kw, message):
    with pytest.raises(ValueError, match=message):
        fn(teacher, student, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_on_gpu_at_full_vocabulary(dtype):
    teacher = logits((64, 262_144), dtype, 15).cuda()
    student = logits((64, 262_144), dtype, 16).cuda()
    want, want_grad = run(kl.kl_divergence.reference, teacher, student, 1.0, "none")
    got, got_grad = run(fused_kl.kl_divergence, teacher, student, 1.0, "none")
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_grad.float().cpu(), want_grad.float().cpu(), atol=1e-12, rtol=2**-8)
