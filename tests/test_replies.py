"""Replies written by a target (minispec.targets.replies): prompt + the target's own continuation, with a
loss mask on the reply only, reproducible and cached."""
import pytest
import torch

import minispec as ms
from minispec.targets import replies
from minispec.targets.replies import Replies, generate_replies
from tiny import tiny_gemma


@pytest.fixture(scope="module")
def model():
    return tiny_gemma(layers=2, seed=0)


@pytest.fixture(scope="module")
def tok():
    return ms.load_target("bolt-nano")[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(replies, "replies_dir", lambda: tmp_path)
    return tmp_path


def test_greedy_replies_are_the_targets_continuations(model, tok, cache):
    r = generate_replies(model, tok, num=5, prompt_len=12, reply_len=9, batch_size=2)
    assert r.input_ids.shape == r.loss_mask.shape == (5, 21)
    assert r.loss_mask[:, :12].sum() == 0
    ar = ms.autoregressive_generate(model, r.input_ids[:, :12], 9)
    for b in range(5):
        n = int(ar.lengths[b])
        assert r.input_ids[b, 12: 12 + n].tolist() == ar.tokens[b, :n].tolist()
        assert r.loss_mask[b, 12:].tolist() == [1] * n + [0] * (9 - n)


def test_replies_are_seeded_and_cached(model, tok, cache):
    a = generate_replies(model, tok, 4, 8, 6, temperature=1.0, seed=3)
    assert len(list(cache.iterdir())) == 1
    b = generate_replies(model, tok, 4, 8, 6, temperature=1.0, seed=3, cache=False)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    c = generate_replies(model, tok, 4, 8, 6, temperature=1.0, seed=4, cache=False)
    assert not torch.equal(a.input_ids[:, 8:], c.input_ids[:, 8:])


def test_batches_are_drawn_by_seed_and_step():
    r = Replies(torch.arange(40).view(10, 4), torch.ones(10, 4, dtype=torch.long))
    x1, _ = r.batch(3, seed=0, step=5)
    x2, _ = r.batch(3, seed=0, step=5)
    x3, _ = r.batch(3, seed=0, step=6)
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)


def test_bad_arguments(model, tok):
    with pytest.raises(ValueError, match="reply_len"):
        generate_replies(model, tok, 2, 8, 0, cache=False)
