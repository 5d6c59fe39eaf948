"""DFlash training (minispec.dflash.train) on a tiny random target and tiny token streams: it learns,
resumes exactly, leaves the target untouched, and saves a drafter the speculative loop runs exactly."""
import pytest
import torch

from minispec.dflash.config import DFlashConfig
from minispec.dflash.drafter import DFlashDrafter
from minispec.dflash.model import DFlashDraftModel
from minispec.dflash.train import Settings, evaluate, train
from minispec.targets.load import load_target
from tiny import assert_same_as_ar, save_with_tokenizer, tiny_gemma

MASK_ID = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_gemma(layers=4, window=16, seed=0)
    with torch.no_grad():  # the tied head of a random tiny model gives logits too flat to fit in a few steps
        model.get_input_embeddings().weight.mul_(5.0)
    folder = save_with_tokenizer(model, tmp_path_factory.mktemp("target"))
    return load_target(folder)[0]


def new_drafter(target, seed=1):
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(target.config, [1, 2], MASK_ID, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  layer_types=["sliding_attention"], sliding_window=16, block_size=8)
    return DFlashDraftModel.for_target(cfg, target)


def stream(n=400, period=37, seed=0):
    """A periodic stream over 8 distinct tokens: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    return (4 + 100 * torch.randint(0, 8, (period,), generator=g)).repeat(n // period + 1)[:n]


def settings(**kw):
    return Settings(**(dict(steps=6, batch=2, seq_len=32, num_anchors=4, lr=3e-2, warmup=1, ckpt_every=2, distill=0.0)
                       | kw))


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_training_reduces_loss_and_leaves_target_unchanged(target, tmp_path):
    before_target = snapshot(target)
    drafter, ids, s = new_drafter(target), stream(), settings(steps=15)
    fixed = ids[:64].view(2, 32)
    before = evaluate(drafter, target, fixed, s)
    history = train(drafter, target, ids, s, tmp_path)
    after = evaluate(drafter, target, fixed, s)
    assert len(history) == 15
    assert after["loss"] < 0.7 * before["loss"], (before, after)
    assert after["accuracy"] > before["accuracy"] + 0.1, (before, after)
    # Frozen target: nothing of it (embedding and shared head included) can get a gradient ...
    assert not any(p.requires_grad for p in target.parameters())
    own = {p.data_ptr() for p in drafter.parameters()}
    assert not own & {p.data_ptr() for p in target.parameters()}
    # ... and its weights are bit-identical after training.
    for k, v in target.state_dict().items():
        assert torch.equal(v, before_target[k]), k


def test_distillation_runs_and_reduces_loss(target, tmp_path):
    drafter, ids, s = new_drafter(target), stream(), settings(steps=10, distill=0.5)
    fixed = ids[:64].view(2, 32)
    before = evaluate(drafter, target, fixed, s)["loss"]
    train(drafter, target, ids, s, tmp_path)
    assert evaluate(drafter, target, fixed, s)["loss"] < before


def test_resume_gives_the_same_weights(target, tmp_path):
    ids, s = stream(seed=1), settings(steps=6)
    whole = new_drafter(target)
    train(whole, target, ids, s, tmp_path / "whole")
    first = new_drafter(target)
    train(first, target, ids, s, tmp_path / "split", stop_after=3)  # "interrupted" after 3 steps
    resumed = new_drafter(target, seed=7)  # a fresh process: weights come from the checkpoint
    history = train(resumed, target, ids, s, tmp_path / "split")
    assert len(history) == 6
    expected = whole.state_dict()
    for k, v in resumed.state_dict().items():
        assert torch.allclose(v, expected[k], atol=1e-6, rtol=0), k
    with pytest.raises(ValueError, match="other settings"):
        train(new_drafter(target), target, ids, settings(steps=6, lr=5e-3), tmp_path / "split")


def test_saved_drafter_runs_exactly_in_the_loop(target, tmp_path):
    drafter = new_drafter(target)
    train(drafter, target, stream(), settings(steps=4), tmp_path / "work")
    drafter.save_pretrained(tmp_path / "out")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "out", target)
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, drafter.state_dict()[k]), k
    prompts = [stream(n=12, seed=3).tolist(), stream(n=7, seed=4).tolist()]
    assert_same_as_ar(target, loaded, prompts, 16)
