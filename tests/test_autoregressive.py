import pytest
import torch

import minispec as ms
from minispec.speculative.batch import as_prompt_batch
from tiny import save_with_tokenizer, tiny_gemma


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random 6-layer Gemma-4 with a 16-token window, saved as a plain local HF folder."""
    return save_with_tokenizer(tiny_gemma(), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return ms.load_target(tiny_folder)[0]


@pytest.fixture(scope="module")
def bolt():
    return ms.load_target("bolt-mini")


def hf_greedy(model, prompts, n):
    batch = as_prompt_batch(prompts, pad_token_id=0)
    out = model.generate(batch.input_ids, attention_mask=batch.attention_mask, do_sample=False,
                         max_new_tokens=n, min_new_tokens=0)
    return out[:, batch.input_ids.shape[1]:]


def same_as_hf(model, prompts, n):
    ours = ms.autoregressive_generate(model, prompts, max_new_tokens=n)
    theirs = hf_greedy(model, prompts, n)
    for i in range(len(prompts)):
        k = int(ours.lengths[i])
        assert torch.equal(ours.tokens[i, :k], theirs[i, :k]), f"row {i} differs from model.generate"
    return ours


def test_load_unknown_name_lists_known():
    with pytest.raises(ValueError, match=r"unknown target 'bolt-maxi'.*bolt-mini"):
        ms.load_target("bolt-maxi")


def test_local_folder_loads_like_a_hub_model(tiny_folder):
    model, tok = ms.load_target(tiny_folder)
    assert model.config.model_type == "gemma4_text" and tok.mask_token_id == 3


def test_greedy_equals_generate_past_the_sliding_window(tiny):
    # Prompts longer than the 16-token window, ragged: the window and the left padding both matter.
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 4096, (n,), generator=g) for n in (40, 23, 57)]
    same_as_hf(tiny, prompts, 30)
    same_as_hf(tiny, prompts[:1], 30)


def test_greedy_equals_generate_on_bolt_mini(bolt):
    model, _ = bolt
    prompts = ms.load_evalset().prompts
    same_as_hf(model, prompts[:1], 48)
    same_as_hf(model, prompts[1:5], 48)


def test_eos_ends_a_sequence_and_pads_after(tiny):
    prompt = torch.randint(4, 4096, (1, 20), generator=torch.Generator().manual_seed(2))
    free = ms.autoregressive_generate(tiny, prompt, max_new_tokens=12)
    # Make the model's 5th greedy token the EOS id by renaming: force eos = that token.
    eos = int(free.tokens[0, 4])
    tiny.generation_config.eos_token_id = eos
    try:
        out = ms.autoregressive_generate(tiny, [prompt[0], prompt[0, :10]], max_new_tokens=12)
    finally:
        tiny.generation_config.eos_token_id = 1
    first_eos = int((free.tokens[0] == eos).nonzero()[0])
    assert int(out.lengths[0]) == first_eos + 1
    assert torch.equal(out.tokens[0, : first_eos + 1], free.tokens[0, : first_eos + 1])
    assert (out.tokens[0, first_eos + 1:] == 0).all()


def test_sampling_is_seeded_and_reproducible(tiny):
    prompt = torch.randint(4, 4096, (2, 12), generator=torch.Generator().manual_seed(3))
    def run(seed):
        return ms.autoregressive_generate(tiny, prompt, 20, temperature=1.0, top_k=50, top_p=0.9,
                                                      generator=torch.Generator().manual_seed(seed)).tokens
    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive int"),
    ({"max_new_tokens": 4, "temperature": -0.5}, "temperature"),
    ({"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.5}, "top_p"),
    ({"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.0}, "top_p"),
])
def test_bad_arguments(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ms.autoregressive_generate(tiny, torch.tensor([[5, 6, 7]]), **kwargs)


def test_empty_prompt(tiny):
    with pytest.raises(ValueError, match="empty prompt at batch index 1"):
        ms.autoregressive_generate(tiny, [[5, 6], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="empty batch"):
        ms.autoregressive_generate(tiny, [], max_new_tokens=3)


def test_out_of_vocab_ids(tiny):
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 4096\)"):
        ms.autoregressive_generate(tiny, torch.tensor([[5, 4096]]), max_new_tokens=3)


def test_non_finite_logits_are_an_error(tiny):
    lm_head = tiny.lm_head.weight
    saved = lm_head.data.clone()
    lm_head.data[7] = float("nan")
    try:
        with pytest.raises(ValueError, match="non-finite logits"):
            ms.autoregressive_generate(tiny, torch.tensor([[5, 6, 7]]), max_new_tokens=3)
    finally:
        lm_head.data.copy_(saved)
