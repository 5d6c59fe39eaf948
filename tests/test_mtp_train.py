"""minispec.mtp.train: the boosting loop is seeded, resumable, and refuses a backbone that moves."""
import pytest
import torch

from minispec.mtp import MTPConfig, MTPHead
from minispec.mtp.train import BoostSettings, boost
from minispec.targets.replies import Replies
from tiny import tiny_gemma

SETTINGS = BoostSettings(steps=4, batch=2, depths=2, context="hsm", warmup=1, ckpt_every=2)


@pytest.fixture(scope="module")
def backbone_and_replies():
    model = tiny_gemma(layers=1)
    ids = torch.randint(3, 4096, (6, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    mask[:, 4:] = 1
    return model, Replies(ids, mask)


def fresh_head(model):
    torch.manual_seed(0)
    return MTPHead(MTPConfig.like(model.config, intermediate_size=64))


def test_resumed_run_equals_an_uninterrupted_one(backbone_and_replies, tmp_path):
    model, replies = backbone_and_replies
    straight = fresh_head(model)
    h1 = boost(straight, model, replies, SETTINGS, tmp_path / "a")
    resumed = fresh_head(model)
    boost(resumed, model, replies, SETTINGS, tmp_path / "b", stop_after=2)
    h2 = boost(fresh_head(model), model, replies, SETTINGS, tmp_path / "b")  # a new process would start fresh
    assert len(h1) == len(h2) == 4 and h1 == h2
    loaded = torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)["model"]
    for name, value in straight.state_dict().items():
        assert torch.equal(value, loaded[name]), name
    assert all(len(h["kl"]) == 2 and 0 < h["acceptance"][0] < 1 for h in h1)


def test_a_backbone_that_changes_is_refused(backbone_and_replies, tmp_path):
    model, replies = backbone_and_replies
    weight = model.lm_head.weight
    original = weight.detach().clone()

    def nudge(step, record):
        with torch.no_grad():
            weight[0, 0] += 1.0

    try:
        with pytest.raises(ValueError, match="backbone changed during boosting"):
            boost(fresh_head(model), model, replies, SETTINGS, tmp_path / "c", on_step=nudge)
        with torch.no_grad():
            weight.copy_(original)
        boost(fresh_head(model), model, replies, SETTINGS, tmp_path / "d", stop_after=2)
        with torch.no_grad():
            weight[0, 0] += 1.0
        with pytest.raises(ValueError, match="other settings \\(backbone: "):
            boost(fresh_head(model), model, replies, SETTINGS, tmp_path / "d")
    finally:
        with torch.no_grad():
            weight.copy_(original)


def test_settings_refuse_an_unknown_context_and_mixing_one_depth():
    with pytest.raises(ValueError, match="context must be one of"):
        BoostSettings(context="ttt")
    with pytest.raises(ValueError, match="hidden-state mixing needs depths >= 2"):
        BoostSettings(depths=1, context="hsm")
    assert BoostSettings(depths=1, context="stitched").context == "stitched"
