"""Property test of the public generation API: over any arguments a user can type, `ms.autoregressive_generate`
and `ms.speculative_generate` either return a valid result or raise ValueError / TypeError with a message, never
another exception; and a greedy speculative result equals the autoregressive one."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import minispec as ms
from minispec.drafters import DraftLMDrafter
from minispec.speculative.sampling import MIN_TEMPERATURE

V, POSITIONS, PAD = 64, 48, 0


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=POSITIONS, pad_token_id=PAD, eos_token_id=1,
                      bos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


TARGET, DRAFT_LM = tiny_llama(0), tiny_llama(1)

# Per argument, values that are valid and values that are not; each example breaks up to two arguments.
good_ids = st.lists(st.integers(3, V - 1), min_size=1, max_size=12)
VALID = {
    "prompt": st.one_of(good_ids, st.lists(good_ids, min_size=1, max_size=3), good_ids.map(torch.tensor),
                        st.integers(1, 3).map(lambda b: torch.arange(3, 3 + 4 * b).view(b, 4))),
    "n": st.integers(1, 30),
    "temperature": st.one_of(st.sampled_from([0.0, 0, MIN_TEMPERATURE, 1e-30, 0.7, 1.0, 100.0]),
                             st.floats(MIN_TEMPERATURE, 10)),
    "top_k": st.one_of(st.none(), st.integers(1, 2 * V)),
    "top_p": st.one_of(st.none(), st.floats(0.01, 1.0)),
    "drafter": st.sampled_from(["ngram", "draft LM"]),
    "k": st.one_of(st.none(), st.integers(1, 6)),
}
INVALID = {
    "prompt": st.one_of(
        st.lists(st.integers(-2, V + 1), max_size=12), st.lists(st.lists(st.integers(-2, V + 1), max_size=12),
                                                                max_size=3),
        st.lists(st.floats(allow_nan=True), max_size=4), st.lists(st.integers(3, V - 1), min_size=POSITIONS - 8),
        st.sampled_from([torch.zeros(2, 0, dtype=torch.long), torch.tensor([[[5]]]), torch.tensor([5.0, 6.0]),
                         torch.tensor([[5, 6]]).bool(), None, 7, {"input_ids": [5, 6]}, [5, [6]], [2**70]]),
        st.sampled_from(["def f(x):", "", "é"])),
    "n": st.one_of(st.integers(-2, 0), st.booleans(), st.just(10**9), st.floats(0, 8), st.none(), st.just("4")),
    "temperature": st.one_of(st.sampled_from([-1.0, 1e-45, 1e-38, math.nan, math.inf, -math.inf, "0.5", None]),
                             st.booleans(), st.floats(max_value=-1e-300)),
    "top_k": st.one_of(st.integers(-2, 0), st.booleans(), st.floats(0, 10), st.just("5")),
    "top_p": st.one_of(st.floats(-0.5, 0), st.floats(1.0001, 2), st.sampled_from([math.nan, "0.9"]), st.booleans()),
    "drafter": st.sampled_from(["a name", None]),
    "k": st.one_of(st.integers(-1, 0), st.booleans(), st.just(2.0)),
}


def drafter_for(kind: str | None):
    if kind == "ngram":
        return ms.load_drafter("ngram", TARGET)
    if kind == "draft LM":
        return DraftLMDrafter(DRAFT_LM, num_draft_tokens=3)
    return "ngram" if kind == "a name" else None


def assert_valid(out, n: int) -> None:
    assert out.tokens.dtype == torch.long and out.tokens.dim() == 2
    assert out.lengths.shape == (out.tokens.shape[0],)
    assert ((out.lengths >= 1) & (out.lengths <= n)).all() and int(out.lengths.max()) == out.tokens.shape[1]
    assert ((out.tokens >= 0) & (out.tokens < V)).all()
    for row, length in zip(out.tokens, out.lengths.tolist()):
        assert (row[length:] == PAD).all()


def clear_error_or(fn):
    """fn()'s result, or None if it raised ValueError / TypeError with a message."""
    try:
        return fn()
    except (ValueError, TypeError) as err:
        assert str(err), f"{type(err).__name__} without a message"
        return None


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(broken=st.sets(st.sampled_from(sorted(VALID)), max_size=2), seeded=st.booleans(), data=st.data())
def test_any_arguments_give_a_valid_result_or_a_clear_error(broken, seeded, data):
    a = {name: data.draw((INVALID if name in broken else VALID)[name], label=name) for name in VALID}
    generator = torch.Generator().manual_seed(0) if seeded else None
    sampling = {"temperature": a["temperature"], "top_k": a["top_k"], "top_p": a["top_p"], "generator": generator}
    ar = clear_error_or(lambda: ms.autoregressive_generate(TARGET, a["prompt"], a["n"], **sampling))
    spec = clear_error_or(lambda: ms.speculative_generate(TARGET, drafter_for(a["drafter"]), a["prompt"], a["n"],
                                                          num_draft_tokens=a["k"], **sampling))
    if not broken:
        assert ar is not None and spec is not None, "valid arguments were refused"
    if ar is not None:
        assert_valid(ar, a["n"])
    if spec is not None:
        assert_valid(spec, a["n"])
        assert math.isfinite(spec.stats.tau) and spec.stats.tau >= 1.0
        if ar is not None and a["temperature"] == 0:
            assert torch.equal(spec.tokens, ar.tokens) and torch.equal(spec.lengths, ar.lengths)


@pytest.mark.parametrize("drafter", ["ngram", "draft LM"])
def test_the_property_test_reaches_valid_results(drafter):
    """The strategies above are not all refusals: a plain call through them gives a result."""
    out = ms.speculative_generate(TARGET, drafter_for(drafter), [[5, 6, 7], [8, 9]], 6, num_draft_tokens=2)
    assert_valid(out, 6)
