"""minispec.mtp.boost: hidden-state mixing, the per-depth KL / acceptance loss, the frozen-backbone guard."""
import pytest
import torch

from minispec.mtp import Backbone, MTPConfig, MTPDrafter, MTPHead, stages
from minispec.mtp.boost import (
    FrozenBackbone,
    boost_loss,
    chained_hidden_state,
    mix_hidden_states,
    run_depths,
    stand_in_gap,
)
from minispec.speculative.batch import as_prompt_batch
from minispec.speculative.drafter import Sampling
from minispec.speculative.output import TargetOutput
from tiny import tiny_gemma

B, S, H = 32, 40, 4


def slot_coded_history(k):
    """history[m] holds 100·m + slot at every slot, so a chosen value says which entry and which slot."""
    slot = torch.arange(S, dtype=torch.float32)[None, :, None].expand(B, S, H)
    return [100.0 * m + slot for m in range(k)]


def test_mixing_draws_each_aligned_candidate_uniformly():
    k = 3
    valid = torch.ones(B, S, dtype=torch.bool)
    mixed = mix_hidden_states(slot_coded_history(k), valid, torch.Generator().manual_seed(0))
    assert (mixed == mixed[..., :1]).all()  # one draw per token, not per channel
    value, slot = mixed[..., 0], torch.arange(S).expand(B, S)
    source = torch.div(value, 100, rounding_mode="floor").long()
    read_slot = value - 100 * source
    # Backbone entry (m = 0) at its own slot j; depth outputs (m >= 1) rolled: read at slot j - 1.
    assert torch.equal(read_slot.long(), torch.where(source == 0, slot, slot - 1))
    assert (source[:, 0] == 0).all()  # slot 0 has no depth output before it: the backbone's h_0
    freq = torch.bincount(source[:, 1:].flatten(), minlength=k).float() / source[:, 1:].numel()
    assert (freq - 1 / k).abs().max() < 0.03, freq  # B·(S-1) = 1248 draws, 3 standard errors ~ 0.04


def test_mixing_falls_back_to_the_backbone_after_padding_and_is_reproducible():
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[:, :10] = False  # left padding: slots 0..9
    history = slot_coded_history(4)
    a = mix_hidden_states(history, valid, torch.Generator().manual_seed(5))
    b = mix_hidden_states(history, valid, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    assert (a[:, :11, 0] < 100).all()  # slot 10's predecessor is padding: backbone entry only
    assert (a[:, 11:, 0] >= 100).any()


def test_without_mixing_depth_k_reads_depth_k_minus_1_one_slot_back():
    history = slot_coded_history(3)
    valid = torch.ones(B, S, dtype=torch.bool)
    x = chained_hidden_state(history, valid)[..., 0]
    assert (x[:, 0] == 0).all() and torch.equal(x[:, 1:], 200.0 + torch.arange(S - 1).expand(B, -1))
    assert torch.equal(chained_hidden_state(history[:1], valid), history[0])


@pytest.fixture(scope="module")
def setup():
    model = tiny_gemma(layers=1)
    torch.manual_seed(0)
    head = MTPHead(MTPConfig.like(model.config, intermediate_size=64))
    ids = torch.randint(3, 4096, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, head, Backbone.of(model), ids


def test_loss_counts_the_right_slots_and_trains_only_the_head(setup):
    model, head, backbone, ids = setup
    res = boost_loss(head, backbone, ids, depths=3)
    assert res.counted.tolist() == [2 * 11, 2 * 10, 2 * 9]  # S-1 slots, minus k-1 at depth k
    assert ((res.kl > 0) & (res.acceptance > 0) & (res.acceptance < 1)).all()
    res.loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in head.parameters())
    head.zero_grad()
    reply = torch.zeros_like(ids)
    reply[:, 8:] = 1  # only the distributions at positions 8..11 count
    assert boost_loss(head, backbone, ids, depths=2, loss_mask=reply).counted.tolist() == [2 * 4, 2 * 4]


def test_depth_one_kl_is_kl_of_the_backbone_next_position(setup):
    model, head, backbone, ids = setup
    with torch.no_grad():
        res = boost_loss(head, backbone, ids, depths=1)
        teacher, hidden = backbone.run(ids)
        student = run_depths(head, backbone, hidden, ids, 1)[0]
        p, log_q = torch.softmax(teacher[:, 1:], -1), torch.log_softmax(student[:, :-1], -1)
        want = (p * (p.log() - log_q)).sum(-1).mean()
    assert res.kl[0].item() == pytest.approx(want.item(), rel=1e-5)


def test_hsm_changes_later_depths_only(setup):
    _, head, backbone, ids = setup
    with torch.no_grad():
        plain = boost_loss(head, backbone, ids, depths=3)
        mixed = boost_loss(head, backbone, ids, depths=3, context="hsm", generator=torch.Generator().manual_seed(0))
    assert mixed.kl[0] == plain.kl[0]  # depth 1 always reads the backbone
    assert (mixed.kl[1:] != plain.kl[1:]).all()


def test_tv_objective_is_one_minus_acceptance_and_trains_the_head(setup):
    _, head, backbone, ids = setup
    res = boost_loss(head, backbone, ids, depths=2, objective="tv")
    assert res.loss.item() == pytest.approx(1 - res.acceptance.mean().item(), rel=1e-6)
    res.loss.backward()
    assert head.layers[0].eh_proj.weight.grad.abs().sum() > 0
    head.zero_grad()


def test_stand_in_gap_is_zero_at_depth_one_only(setup):
    _, head, backbone, ids = setup
    gap = stand_in_gap(head, backbone, ids, depths=3)
    assert gap["cosine"][0].item() == pytest.approx(1.0, abs=1e-6) and gap["relative_error"][0] == 0
    assert (gap["relative_error"][1:] > 0.05).all() and (gap["cosine"][1:] < 0.999).all()


def test_loss_and_gradient_through_the_fused_kl_kernel(setup, monkeypatch):
    fused_kl = pytest.importorskip("minispec.kernels.kl")
    _, head, backbone, ids = setup
    calls = []
    real = fused_kl._FusedKL.apply
    monkeypatch.setattr(fused_kl._FusedKL, "apply", lambda *a: calls.append(1) or real(*a))
    grads = []
    for name in ("torch", "triton"):  # triton: the Triton interpreter on CPU (conftest sets it up)
        monkeypatch.setenv("MINISPEC_BACKEND", name)
        res = boost_loss(head, backbone, ids[:, :8], depths=2)
        res.loss.backward()
        grads.append((res.loss.detach(), head.layers[0].eh_proj.weight.grad.clone()))
        head.zero_grad()
    assert len(calls) == 2  # one kernel call per depth, in the triton pass only
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], atol=1e-8, rtol=1e-4)


def test_frozen_backbone_guard(setup):
    model, *_ = setup
    guard = FrozenBackbone(model)
    guard.check()
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    try:
        with pytest.raises(ValueError, match="backbone changed during boosting"):
            guard.check()
    finally:
        with torch.no_grad():
            model.lm_head.weight[0, 0] -= 1.0


def test_bad_input_is_a_clear_error(setup):
    _, head, backbone, ids = setup
    with pytest.raises(ValueError, match=">= 3 tokens"):
        boost_loss(head, backbone, ids[:, :2], depths=1)
    with pytest.raises(ValueError, match="loss_mask"):
        boost_loss(head, backbone, ids, depths=1, loss_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="at least 2 depths"):
        boost_loss(head, backbone, ids, depths=1, context="hsm")
    with pytest.raises(ValueError, match="context must be one of"):
        boost_loss(head, backbone, ids, depths=2, context="ttt")
    with pytest.raises(ValueError, match="depths must be an int >= 1"):
        boost_loss(head, backbone, ids, depths=0)
    with pytest.raises(ValueError, match="objective must be one of"):
        boost_loss(head, backbone, ids, depths=1, objective="ce")
    with pytest.raises(ValueError, match="vocab size"):
        boost_loss(MTPHead(MTPConfig(hidden_size=64, vocab_size=100)), backbone, ids, depths=1)


def drafting_probs(drafter: MTPDrafter, ids, hidden, k: int, generator):
    """What MTPDrafter drafts for every cycle start c of one sequence ids [1, L]: the prompt ids[:c+1] (its
    hidden states from `hidden`), last = ids[c+1], K sampled drafts at T = 1. Returns, per c, the sequence
    the drafts would continue (ids[:c+2] ++ d_1..d_{K-1}) and q [K, V], the drafter's distribution per depth."""
    L = ids.shape[1]
    rows, qs = [], []
    for c in range(L - 1):
        drafter.begin(as_prompt_batch(ids[:, : c + 1], 0), TargetOutput(None, (hidden[:, : c + 1],)))
        proposal = drafter.propose(ids[:, c + 1], k, Sampling(temperature=1.0), generator)
        rows.append(torch.cat([ids[0, : c + 2], proposal.tokens[0, : k - 1]]))
        qs.append(proposal.q[0])
    return rows, qs


def max_logit_gaps(head, backbone, rows, qs, k: int, context: str):
    """Per depth, max over cycle starts c and tokens of |Δ log-prob| between `context`'s training path on
    the continued sequences (one row per c, right-padded: the head and backbone are causal) and drafting."""
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=3) for r in rows])
    with torch.no_grad():
        _, hidden = backbone.run(ids)
        logits = run_depths(head, backbone, hidden, ids, k, context=context)
    gaps = []
    for depth in range(k):  # chain c's depth k sits at slot c+k-1
        log_p = torch.stack([torch.log_softmax(logits[depth][c, c + depth], -1) for c in range(len(rows))])
        log_q = torch.stack([q[depth].log() for q in qs])
        gaps.append(((log_p - log_q) - (log_p - log_q).mean(-1, keepdim=True)).abs().max().item())
    return gaps


@pytest.mark.parametrize("which", ["shipped", "two attention layers"])
def test_stitched_context_gives_the_drafters_logits_at_every_depth_and_cycle_start(which):
    """Test-time training's logits equal MTPDrafter's, for every depth and every cycle start of a real
    eval-set prompt; unrolled training agrees at depth 1 only (its later depths attend to stand-ins)."""
    import minispec as ms

    k = 4
    model = stages.load_backbone(stages.POST_FOLDER)
    if which == "shipped":
        head = MTPHead.from_pretrained(stages.POST_FOLDER)
    else:  # attention after attention: later layers' keys depend on the context, too
        torch.manual_seed(0)
        head = MTPHead(MTPConfig.like(model.config, pattern="*-*", head_dim=16)).eval()
    backbone = Backbone.of(model)
    ids = ms.load_evalset().prompts[1][None, :20]
    with torch.no_grad():
        _, hidden = backbone.run(ids)
    rows, qs = drafting_probs(MTPDrafter(head, model, k), ids, hidden, k, torch.Generator().manual_seed(0))
    assert max(max_logit_gaps(head, backbone, rows, qs, k, "stitched")) < 1e-4
    unrolled = max_logit_gaps(head, backbone, rows, qs, k, "unrolled")
    assert unrolled[0] < 1e-4 and min(unrolled[1:]) > 1e-2, unrolled


def test_stitched_context_trains_the_head_only_and_counts_like_the_others(setup):
    model, head, backbone, ids = setup
    res = boost_loss(head, backbone, ids, depths=3, context="stitched")
    assert res.counted.tolist() == [2 * 11, 2 * 10, 2 * 9]
    res.loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    head.zero_grad()
    with torch.no_grad():
        plain = boost_loss(head, backbone, ids, depths=3)
        stitched = boost_loss(head, backbone, ids, depths=3, context="stitched")
    torch.testing.assert_close(stitched.kl[0], plain.kl[0])  # depth 1 reads the backbone in both
    assert (stitched.kl[1:] != plain.kl[1:]).all()
