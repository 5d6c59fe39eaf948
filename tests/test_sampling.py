"""Temperature / top-k / top-p: the reference's semantics, Hugging Face agreement, the Triton kernel.

The kernel is checked against the reference on DEVICE: on CPU under the Triton interpreter (conftest.py
sets TRITON_INTERPRET=1), compiled on a CUDA machine. The kept sets must be identical and the
probabilities within ATOL.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from minispec import backend
from minispec.speculative.sampling import (
    MIN_TEMPERATURE,
    check_sampling_args,
    greedy,
    next_token,
    sample,
    sampling_probs,
    top_p_mask,
)

ATOL = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
reference, kernel = sampling_probs.reference, sampling_probs.kernel


def probs_of(values):
    """logits whose softmax is `values` (up to rounding)."""
    return torch.tensor(values, dtype=torch.float64).log().float()


# --- the reference, by hand ------------------------------------------------------------------------

def test_temperature_divides_the_logits():
    logits = torch.tensor([0.0, math.log(3)])  # p = [1/4, 3/4]; at temperature T, p ∝ [1, 3**(1/T)]
    for T in (1.0, 0.5, 2.0):
        w = 3 ** (1 / T)
        assert torch.allclose(reference(logits, T), torch.tensor([1 / (1 + w), w / (1 + w)]), atol=ATOL)


def test_temperature_zero_is_one_hot_on_the_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-math.inf, 0.0, -1.0, -2.0]], dtype=torch.bfloat16)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    out = reference(logits, 0.0, top_k=3, top_p=0.1)  # top_k and top_p are ignored
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0])
    e = [math.exp(v) for v in (3.0, 2.0, 2.0)]
    expected = torch.tensor([x / sum(e) for x in e] + [0.0, 0.0])
    assert torch.allclose(reference(logits, 1.0, top_k=2), expected, atol=ATOL)  # 3rd ties the 2nd
    assert torch.allclose(reference(logits, 1.0, top_k=3), expected, atol=ATOL)
    assert torch.equal(reference(logits, 1.0, top_k=1), torch.tensor([1.0, 0, 0, 0, 0]))
    assert torch.equal(reference(logits, 1.0, top_k=5), reference(logits, 1.0))
    assert torch.equal(reference(logits, 1.0, top_k=99), reference(logits, 1.0))


def test_top_p_keeps_a_token_iff_the_mass_strictly_above_it_is_below_top_p():
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])  # dyadic: every partial sum is exact in float32
    # mass strictly above each token: [0, 0.5, 0.75, 0.75]
    assert top_p_mask(p, 0.5).tolist() == [True, False, False, False]
    assert top_p_mask(p, 0.5000001).tolist() == [True, True, False, False]
    assert top_p_mask(p, 0.75).tolist() == [True, True, False, False]  # the tied pair goes together
    assert top_p_mask(p, 0.7500001).tolist() == [True, True, True, True]
    assert top_p_mask(p, 1e-9).tolist() == [True, False, False, False]  # the argmax always stays
    assert top_p_mask(torch.full((4,), 0.25), 1e-9).all()  # ... and so do the tokens tied with it


def test_top_p_treats_ties_alike_where_sorting_would_split_them():
    # Hugging Face's sort-and-cumulate would keep 0.4 and only one of the two 0.3s for top_p = 0.5.
    assert top_p_mask(torch.tensor([0.4, 0.3, 0.3]), 0.5).tolist() == [True, True, True]


def test_top_p_renormalises_over_the_nucleus():
    out = reference(probs_of([0.5, 0.25, 0.125, 0.125]), 1.0, top_p=0.6)
    assert torch.allclose(out, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]), atol=ATOL)


def test_temperature_comes_before_top_p():
    logits = probs_of([0.6, 0.3, 0.1])
    assert torch.allclose(reference(logits, 1.0, top_p=0.7), torch.tensor([2 / 3, 1 / 3, 0]), atol=ATOL)
    # At T = 1/4, p ∝ [0.6**4, 0.3**4, 0.1**4] = [0.1296, 0.0081, 0.0001]: the head alone holds 0.94.
    assert torch.equal(reference(logits, 0.25, top_p=0.7), torch.tensor([1.0, 0.0, 0.0]))


def test_top_k_comes_before_top_p():
    # Top-k 2 leaves [4/7, 3/7]; 4/7 > 0.5 is above the second token, so top-p 0.5 keeps one token.
    # (Top-p first would keep 0.4 and 0.3, whose mass above is 0.4 < 0.5.)
    out = reference(probs_of([0.4, 0.3, 0.2, 0.1]), 1.0, top_k=2, top_p=0.5)
    assert torch.equal(out, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def hf_probs(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


HF_COMBOS = [(1.0, None, None), (0.7, 10, None), (1.3, None, 0.9), (0.8, 20, 0.6), (2.0, 3, 0.3)]


@pytest.mark.parametrize("temperature,top_k,top_p", HF_COMBOS)
def test_matches_hugging_face_warpers_on_distinct_logits(temperature, top_k, top_p):
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3
    ours, theirs = reference(logits, temperature, top_k, top_p), hf_probs(logits, temperature, top_k, top_p)
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours, theirs, atol=ATOL, rtol=0)


# --- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,name", [
    ((-0.5, None, None), "temperature"), ((math.nan, None, None), "temperature"),
    ((math.inf, None, None), "temperature"), ((1e-45, None, None), "temperature must be 0 .greedy. or at least"),
    ((1.0, 0, None), "top_k"), ((1.0, None, 0.0), "top_p"), ((1.0, None, 1.5), "top_p"),
    ((1.0, None, math.nan), "top_p"),
])
def test_bad_sampling_args_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        check_sampling_args(*args)


@pytest.mark.parametrize("args,name", [
    (("1", None, None), "temperature must be a number"), ((True, None, None), "temperature must be a number"),
    ((1.0, 2.5, None), "top_k must be an int"), ((1.0, True, None), "top_k must be an int"),
    ((1.0, None, "0.9"), "top_p must be a number"),
])
def test_wrong_sampling_arg_types_name_the_argument(args, name):
    with pytest.raises(TypeError, match=name):
        check_sampling_args(*args)


# Under the interpreter NumPy warns when (logit - max) / T rounds to -inf: that is the intended result.
@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("fn", [reference, kernel], ids=["reference", "kernel"])
def test_tiny_temperature_is_the_limit_distribution(fn):
    """logits / T overflows float32 at T = 1e-37; subtracting the row's max first keeps every z <= 0, so a
    tiny temperature gives the T -> 0 limit: all the mass on the argmax, split evenly on a tie."""
    logits = torch.tensor([[10.0, 50.0, -3.0, 49.0], [7.0, 7.0, 1.0, -20.0]])
    for T in (MIN_TEMPERATURE, 1e-37, 1e-30):
        assert torch.equal(fn(logits, T), torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))


@pytest.mark.parametrize("fn", [reference, kernel], ids=["reference", "kernel"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_plus_inf_logits_raise(fn, bad):
    logits = torch.zeros(2, 5, device=DEVICE)
    logits[1, 3] = bad
    with pytest.raises(ValueError, match="non-finite logits"):
        fn(logits, 0.8, top_k=2)


@pytest.mark.parametrize("fn", [reference, kernel], ids=["reference", "kernel"])
def test_a_row_of_only_minus_inf_raises_but_minus_inf_alone_masks(fn):
    logits = torch.tensor([[0.0, -math.inf, 1.0], [-math.inf, -math.inf, -math.inf]], device=DEVICE)
    with pytest.raises(ValueError, match="non-finite logits"):
        fn(logits, 1.0)
    assert fn(logits[:1], 1.0)[0, 1] == 0


# --- the Triton kernel against the reference (Triton interpreter on CPU) --------------------------

COMBOS = [(1.0, None, None), (0.7, 5, None), (0.8, None, 0.9), (1.3, 40, 0.7), (0.6, 1, None),
          (1.0, 10_000, 0.5), (0.0, 3, 0.5)]


def assert_same(out, expected):
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert torch.equal(out > 0, expected > 0), "kept sets differ"
    assert torch.allclose(out, expected, atol=ATOL, rtol=0)


# V = 7 fits one chunk; 2500 spans three chunks of 1024 and ends mid-chunk; [2, 2, V] has two leading dims.
@pytest.mark.parametrize("shape", [(3, 7), (2, 2, 100), (2, 2500)], ids=str)
@pytest.mark.parametrize("temperature,top_k,top_p", COMBOS)
def test_kernel_equals_reference(shape, temperature, top_k, top_p):
    logits = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2).to(DEVICE)
    assert_same(kernel(logits, temperature, top_k, top_p), reference(logits, temperature, top_k, top_p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 7, None), (0.5, None, 0.6), (1.0, 50, 0.95)])
def test_kernel_equals_reference_on_ties_and_masked_tokens(dtype, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(-4, 5, (4, 300), generator=g).to(dtype)  # many ties everywhere
    logits[:, ::7] = -math.inf
    logits[0, :40] = torch.tensor([0.0, -0.0] * 20, dtype=dtype)  # equal floats with different bits
    logits = logits.to(DEVICE)
    assert_same(kernel(logits, temperature, top_k, top_p), reference(logits, temperature, top_k, top_p))


def test_kernel_top_k_counts_minus_zero_as_zero():
    logits = torch.tensor([[1.0, 0.0, -0.0, -1.0], [1.0, -0.0, 0.0, -1.0]], device=DEVICE)
    assert_same(kernel(logits, 1.0, top_k=2), reference(logits, 1.0, top_k=2))
    assert (kernel(logits, 1.0, top_k=2)[:, :3] > 0).all()


def test_kernel_argmax_takes_the_first_maximum_across_chunks():
    logits = torch.zeros(3, 2500, device=DEVICE)
    logits[0, [100, 2000]] = 5.0  # tie between the first and the second chunk
    logits[1, [1500, 2400]] = 5.0  # tie inside later chunks
    logits[2, 2499] = 5.0  # the last column
    assert kernel(logits, 0.0).argmax(dim=-1).tolist() == [100, 1500, 2499]
    assert_same(kernel(logits, 0.0), reference(logits, 0.0))


def test_kernel_accepts_a_single_row_and_an_empty_batch():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert_same(kernel(logits, 0.9, 10, 0.8), reference(logits, 0.9, 10, 0.8))
    assert kernel(torch.zeros(0, 5, device=DEVICE), 0.9, 2, 0.5).shape == (0, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_on_cuda_with_a_large_vocabulary(dtype):
    # Temperatures are powers of two: torch on CUDA may divide by multiplying with 1/T, which for
    # other T can round z differently from the kernel's correctly rounded division.
    g = torch.Generator("cuda").manual_seed(4)
    logits = (torch.randn(4, 262_144, device="cuda", generator=g) * 3).to(dtype)
    for temperature, top_k, top_p in [(1.0, None, None), (0.5, 50, None), (1.0, None, 0.9), (2.0, 1000, 0.95),
                                      (0.0, None, None)]:
        assert_same(kernel(logits, temperature, top_k, top_p), reference(logits, temperature, top_k, top_p))


# --- dispatch --------------------------------------------------------------------------------------

def make_dispatched():
    """A fresh dispatched function whose reference records that it ran."""
    ran = []

    def fake_reference(logits, temperature=1.0, top_k=None, top_p=None):
        ran.append(True)
        return torch.zeros_like(logits)

    return backend.dispatch("sampling:sampling_probs")(fake_reference), ran


# "auto" runs the kernel on CUDA tensors only.
@pytest.mark.parametrize("name,reference_runs",
                         [("torch", True), ("auto", DEVICE == "cpu"), ("triton", False)])
def test_dispatch_follows_minispec_backend(monkeypatch, name, reference_runs):
    monkeypatch.setenv("MINISPEC_BACKEND", name)
    fn, ran = make_dispatched()
    out = fn(torch.randn(2, 5, device=DEVICE), 1.0)
    assert bool(ran) == reference_runs
    if not reference_runs:  # the kernel ran: real probabilities, not the fake zeros
        assert torch.allclose(out.sum(-1).cpu(), torch.ones(2), atol=ATOL)


def test_unknown_backend_raises_naming_the_allowed_values(monkeypatch):
    monkeypatch.setenv("MINISPEC_BACKEND", "cuda")
    with pytest.raises(ValueError, match="'cuda'.*auto, torch, triton"):
        sampling_probs(torch.randn(2, 5))


def test_forced_triton_without_triton_says_why(monkeypatch):
    monkeypatch.setenv("MINISPEC_BACKEND", "triton")
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    fn, _ = make_dispatched()
    with pytest.raises(RuntimeError, match="triton does not import.*MINISPEC_BACKEND=torch"):
        fn(torch.randn(2, 5))


@pytest.mark.slow
def test_kernel_compiled_for_gpu_refuses_cpu_tensors(tmp_path):
    # An explicit TRITON_INTERPRET=0 wins over MINISPEC_BACKEND=triton, so the kernel is compiled.
    env = {**os.environ, "MINISPEC_BACKEND": "triton", "TRITON_INTERPRET": "0"}
    code = ("import torch; from minispec.speculative.sampling import sampling_probs;"
            "sampling_probs(torch.zeros(2, 5))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "set TRITON_INTERPRET=1 before importing minispec" in out.stderr


def test_enable_interpreter_if_needed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MINISPEC_BACKEND", "torch")
    backend.enable_interpreter_if_needed()
    assert "TRITON_INTERPRET" not in os.environ
    monkeypatch.setenv("MINISPEC_BACKEND", "triton")
    backend.enable_interpreter_if_needed()
    assert os.environ["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # an explicit choice is left alone
    backend.enable_interpreter_if_needed()
    assert os.environ["TRITON_INTERPRET"] == "0"


# --- drawing tokens --------------------------------------------------------------------------------

def test_sample_is_reproducible_and_stays_in_the_support():
    probs = reference(torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(5)), 1.0, top_k=4)
    draws = [sample(probs, torch.Generator().manual_seed(6)) for _ in range(2)]
    assert draws[0].shape == (2, 3) and draws[0].dtype == torch.long
    assert torch.equal(draws[0], draws[1])
    for _ in range(20):
        assert (probs.gather(-1, sample(probs)[..., None]) > 0).all()


def test_greedy_and_temperature_zero_draw_no_random_numbers():
    logits = torch.tensor([[0.0, 2.0, 2.0], [3.0, 1.0, 3.0]])
    assert greedy(logits).tolist() == [1, 0]
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    assert next_token(logits, 0.0, generator=g).tolist() == [1, 0]
    assert torch.equal(g.get_state(), state)
