"""DFlash training blocks: anchors, the block mask, same-position labels and decayed loss weights.

The mask is checked against a brute-force construction written straight from the rules of the public
trainers (SpecForge specforge/core/dflash.py, Model Optimizer hf_dflash.py; see minispec.dflash.mask);
each known mask bug (M1, M3-M5, numbered as in test_dflash_model.py), built into that brute force on
purpose, must disagree with the real mask (test_dflash_model.py shows each also breaks training =
inference logits).
"""
import math

import pytest
import torch

from minispec.dflash import mask as dm


def brute_force_mask(anchors, valid, S, T, window=None, *, causal_block=False, anchor_visible=False,
                     see_other_blocks=False, padding_sees=False):
    """allow[b, q, key] from the rules, one entry at a time. The keyword flags inject the known bugs:
    causal_block (M1), anchor_visible (`<=` instead of `<`, M3), see_other_blocks (cross-block leak, M4),
    padding_sees (padding blocks not isolated, M5)."""
    Bs, N = anchors.shape
    allow = torch.zeros(Bs, N * T, S + N * T, dtype=torch.bool)
    for b in range(Bs):
        for j in range(N):
            a = int(anchors[b, j])
            if not valid[b, j] and not padding_sees:
                continue
            for k in range(T):
                q, pos = j * T + k, a + k
                for c in range(S):
                    before = c <= a if anchor_visible else c < a
                    allow[b, q, c] = before and (window is None or pos - c < window)
                for j2 in range(N):
                    for k2 in range(T):
                        same = j2 == j and (k2 <= k or not causal_block)
                        allow[b, q, S + j2 * T + k2] = same or (see_other_blocks and j2 != j)
    return allow


@pytest.fixture
def blocks():
    """Two sequences of length 20, blocks of 4; row 1 has a padding block."""
    anchors = torch.tensor([[2, 7, 13], [5, 9, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    return anchors, valid, 20, 4


@pytest.mark.parametrize("window", [None, 6, 4])
def test_mask_equals_brute_force(blocks, window):
    anchors, valid, S, T = blocks
    assert torch.equal(dm.training_mask(anchors, valid, S, T, window), brute_force_mask(anchors, valid, S, T, window))


@pytest.mark.parametrize("bug", ["causal_block", "anchor_visible", "see_other_blocks", "padding_sees"])
def test_each_known_mask_bug_differs_from_the_mask(blocks, bug):
    anchors, valid, S, T = blocks
    wrong = brute_force_mask(anchors, valid, S, T, 6, **{bug: True})
    assert not torch.equal(dm.training_mask(anchors, valid, S, T, 6), wrong)


def test_padding_blocks_see_nothing_and_nobody_sees_them(blocks):
    anchors, valid, S, T = blocks
    allow = dm.training_mask(anchors, valid, S, T)
    pad = slice(2 * T, 3 * T)  # block 2 of row 1
    assert not allow[1, pad].any()
    assert not allow[1, :, S + 2 * T: S + 3 * T].any()


def test_random_mask_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    S, T = 23, 3
    loss_mask = (torch.rand(3, S, generator=g) > 0.3).long()
    anchors, valid = dm.sample_anchors(loss_mask, T, 5, g)
    for window in (None, 5):
        assert torch.equal(dm.training_mask(anchors, valid, S, T, window),
                           brute_force_mask(anchors, valid, S, T, window))


# --- anchors --------------------------------------------------------------------------------------

def test_anchors_are_drawn_per_sequence_from_its_own_candidates():
    S, T = 30, 4
    loss_mask = torch.zeros(3, S, dtype=torch.long)
    loss_mask[0, 10:] = 1  # answer-only loss
    loss_mask[1, :12] = 1  # a short sequence, right-padded
    loss_mask[2, 25:] = 1  # one candidate only (t <= S - T = 26): 25 and 26
    anchors, valid = dm.sample_anchors(loss_mask, T, 6, torch.Generator().manual_seed(1))
    assert anchors.shape == valid.shape == (3, 6)
    for b in range(3):
        a = anchors[b][valid[b]].tolist()
        assert a == sorted(set(a)), "anchors are distinct and sorted"
        assert all(1 <= t <= S - T and loss_mask[b, t] == 1 for t in a)
        assert valid[b].tolist() == sorted(valid[b].tolist(), reverse=True), "padding blocks come last"
        assert (anchors[b][~valid[b]] == 0).all()
    assert valid.sum(1).tolist() == [6, 6, 2]


def test_anchor_sampling_is_seeded_and_uniform_over_candidates():
    loss_mask = torch.ones(1, 12, dtype=torch.long)

    def draw(seed):
        return dm.sample_anchors(loss_mask, 4, 3, torch.Generator().manual_seed(seed))[0]

    assert torch.equal(draw(5), draw(5))
    counts = torch.zeros(12)
    g = torch.Generator().manual_seed(6)
    n = 4000
    for _ in range(n):
        counts[dm.sample_anchors(loss_mask, 4, 3, g)[0][0]] += 1
    # Candidates 1..8, each chosen with probability 3/8. Binomial sd = sqrt(n p (1-p)) ~ 30.6: 5 sd bounds.
    assert counts[0] == 0 and counts[9:].sum() == 0
    expected, sd = n * 3 / 8, math.sqrt(n * 3 / 8 * 5 / 8)
    assert ((counts[1:9] - expected).abs() < 5 * sd).all(), counts


def test_no_candidates_gives_no_blocks():
    anchors, valid = dm.sample_anchors(torch.ones(2, 4, dtype=torch.long), 4, 8)
    assert anchors.shape == (2, 0) and valid.shape == (2, 0)
    with pytest.raises(ValueError, match="num_anchors"):
        dm.sample_anchors(torch.ones(1, 9), 4, 0)


# --- blocks, labels, weights, loss ---------------------------------------------------------------------

def test_blocks_labels_are_the_same_positions_and_the_anchor_has_no_loss():
    x = torch.arange(100, 120)[None]  # token = 100 + position
    anchors, valid = torch.tensor([[3, 15]]), torch.tensor([[True, True]])
    b = dm.make_blocks(x, anchors, valid, 8, mask_token_id=7)
    assert b.input_ids[0, 0].tolist() == [103] + [7] * 7
    assert b.positions[0, 0].tolist() == list(range(3, 11))
    assert b.labels[0, 0].tolist() == list(range(103, 111)), "position k is labelled x[a + k], not x[a + k + 1]"
    assert b.labels[0, 1, :5].tolist() == list(range(115, 120))
    decay = [0.0] + [math.exp(-(k - 1) / 4) for k in range(1, 8)]
    assert torch.allclose(b.weights[0, 0], torch.tensor(decay))
    assert b.weights[0, 0, 0] == 0 and b.weights[0, 0, 1] == 1.0
    assert torch.allclose(b.weights[0, 1], torch.tensor(decay[:5] + [0.0] * 3)), "no weight past the end"


def test_loss_weights_follow_the_loss_mask_and_validity():
    loss_mask = torch.ones(2, 20, dtype=torch.long)
    loss_mask[0, 6] = 0
    anchors, valid = torch.tensor([[4, 10], [4, 0]]), torch.tensor([[True, True], [True, False]])
    w = dm.loss_weights(anchors, valid, loss_mask, 4, gamma=2.0)
    assert w[0, 0].tolist() == pytest.approx([0.0, 1.0, 0.0, math.exp(-1.0)])  # x[6] is not trained on
    assert w[1, 1].tolist() == [0.0] * 4  # a padding block
    assert w[1, 0].tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)])


def test_decay_gamma_defaults_and_bad_values():
    assert torch.allclose(dm.decay_weights(16), torch.tensor([0.0] + [math.exp(-(k - 1) / 7) for k in range(1, 16)]))
    assert torch.allclose(dm.decay_weights(10)[1:3], torch.tensor([1.0, math.exp(-1 / 5)]))
    with pytest.raises(ValueError, match="no default gamma for block size 4"):
        dm.decay_weights(4)
    with pytest.raises(ValueError, match="gamma must be a positive"):
        dm.decay_weights(8, gamma=0.0)


def test_loss_is_the_weight_normalised_cross_entropy():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 4, 11, generator=g)
    labels = torch.randint(0, 11, (2, 3, 4), generator=g)
    weights = torch.rand(2, 3, 4, generator=g)
    ce = -torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    expected = (weights * ce).sum() / weights.sum()
    assert torch.allclose(dm.dflash_loss(logits, labels, weights), expected)
    assert torch.allclose(dm.dflash_loss(logits, labels, 5 * weights), expected), "normalised by the weights' sum"
    assert dm.dflash_loss(logits, labels, torch.zeros_like(weights)) == 0
    hits = (logits.argmax(-1) == labels).float()
    assert dm.weighted_accuracy(logits, labels, weights) == pytest.approx(float((hits * weights).sum() / weights.sum()))
