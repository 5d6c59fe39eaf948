"""minispec.mtp.sft (joint backbone + head loss) and boost.distribution_shift (post-training drift)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from minispec.mtp import Backbone, MTPConfig, MTPHead
from minispec.mtp.boost import distribution_shift, run_depths
from minispec.mtp.sft import joint_loss
from tiny import tiny_gemma


@pytest.fixture()
def setup():
    model = tiny_gemma(layers=1)
    torch.manual_seed(0)
    head = MTPHead(MTPConfig.like(model.config, intermediate_size=64))
    ids = torch.randint(3, 4096, (2, 10), generator=torch.Generator().manual_seed(1))
    return model, head, ids


def test_joint_loss_values_and_gradients(setup):
    model, head, ids = setup
    res = joint_loss(model, head, ids, depths=2, mtp_weight=0.1)
    with torch.no_grad():
        logits, hidden = Backbone.of(model).run(ids)
        lm = F.cross_entropy(logits[:, :-1].reshape(-1, 4096), ids[:, 1:].reshape(-1))
        depth1 = run_depths(head, Backbone.of(model), hidden, ids, 1)[0]
        ce1 = F.cross_entropy(depth1[:, :-2].reshape(-1, 4096), ids[:, 2:].reshape(-1))
    assert res.lm.item() == pytest.approx(lm.item(), rel=1e-5)
    assert res.mtp[0].item() == pytest.approx(ce1.item(), rel=1e-5)
    assert res.loss.item() == pytest.approx((res.lm + 0.1 * res.mtp.mean()).item(), rel=1e-6)
    res.loss.backward()
    assert model.lm_head.weight.grad is not None and head.layers[0].eh_proj.weight.grad is not None


def test_detached_backbone_gets_only_its_own_lm_gradient(setup):
    model, head, ids = setup
    res = joint_loss(model, head, ids, depths=2, detach_backbone=True)
    res.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    joint_loss(model, head, ids, depths=2, mtp_weight=0.0).loss.backward()
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-7, rtol=1e-5)


def test_distribution_shift_is_zero_for_a_copy_and_positive_after_a_change(setup):
    model, _, ids = setup
    same = distribution_shift(model, copy.deepcopy(model), ids)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["one_minus_tv"] == pytest.approx(1.0, abs=1e-5)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.lm_head.weight.mul_(3.0)
    shift = distribution_shift(model, moved, ids)
    assert shift["kl"] > 0.01 and shift["one_minus_tv"] < 0.99


def test_bad_input(setup):
    model, head, ids = setup
    with pytest.raises(ValueError, match=">= 3 tokens"):
        joint_loss(model, head, ids[:, :2], depths=1)
    with pytest.raises(ValueError, match="loss_mask"):
        joint_loss(model, head, ids, depths=1, loss_mask=torch.ones(1, 10))
