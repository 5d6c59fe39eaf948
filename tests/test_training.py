"""minispec.training: the schedule, the weight-decay groups, and the one loop every trainer uses: it resumes
bit-exactly, refuses a checkpoint written with other settings, and writes its state atomically."""
import copy
import math
from dataclasses import dataclass

import pytest
import torch

from minispec import training


@dataclass
class ToySettings(training.Settings):
    steps: int = 8
    warmup: int = 2
    lr: float = 1e-2
    weight_decay: float = 0.1
    ckpt_every: int = 3
    noise: float = 0.1


def toy_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


def run(model, s, path, **kw):
    """Regression on seeded data: the batch and the loss's own random draw depend only on (seed, step)."""
    opt = torch.optim.AdamW(training.weight_decay_groups(model.parameters(), s.weight_decay), lr=s.lr)

    def batch_loss(step):
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        x = torch.randn(4, 6, generator=g)
        y = x.sum(-1, keepdim=True) + s.noise * torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss, {"loss": loss.item(), "step": step, "per_row": [1.0, 2.0]}

    return training.train_loop({"model": model}, opt, s, batch_loss, path, progress=False, **kw), opt


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_its_floor():
    s = ToySettings(steps=110, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert [training.lr_at(i, s) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert training.lr_at(9, s) == pytest.approx(1.0) and training.lr_at(10, s) == pytest.approx(1.0)
    assert training.lr_at(60, s) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert training.lr_at(35, s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert training.lr_at(110, s) == pytest.approx(0.1)
    lrs = [training.lr_at(i, s) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_weight_decay_only_on_matrices():
    model = toy_model()
    decayed, plain = training.weight_decay_groups(model.parameters(), 0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert [p.shape for p in decayed["params"]] == [(16, 6), (1, 16)]
    assert len(plain["params"]) == 4 and all(p.dim() == 1 for p in plain["params"])  # 2 biases, norm gain + bias


def test_weights_digest_names_the_weights():
    model = toy_model()
    assert training.weights_digest(model) == training.weights_digest(copy.deepcopy(model))
    with torch.no_grad():
        model[0].weight[0, 0] += 1e-3
    assert training.weights_digest(model) != training.weights_digest(toy_model())


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    s = ToySettings()
    whole = toy_model()
    h_whole, whole_opt = run(whole, s, tmp_path / "whole" / "state.pt")
    run(toy_model(), s, tmp_path / "split" / "state.pt", stop_after=4)  # "interrupted" after 4 steps
    state = torch.load(tmp_path / "split" / "state.pt", weights_only=False)
    assert state["step"] == 4 and len(state["history"]) == 4 and state["settings"]["noise"] == 0.1
    resumed = toy_model(seed=7)  # a fresh process: weights and optimizer come from the checkpoint
    h_resumed, resumed_opt = run(resumed, s, tmp_path / "split" / "state.pt")
    assert h_resumed == h_whole and [h["step"] for h in h_whole] == list(range(8))
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    for a, b in zip(whole_opt.state.values(), resumed_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not resumed.training  # modules are left in eval mode
    assert sorted(p.name for p in (tmp_path / "split").iterdir()) == ["state.pt"]  # no temporary file left


def test_a_checkpoint_resumes_only_with_its_settings_and_its_must_match_entries(tmp_path):
    path = tmp_path / "state.pt"
    run(toy_model(), ToySettings(), path, stop_after=3, must_match={"backbone": "abc"})
    with pytest.raises(ValueError, match="other settings") as err:
        run(toy_model(), ToySettings(lr=2e-2, noise=0.2), path, must_match={"backbone": "abc"})
    message = str(err.value)
    assert "lr: 0.01 there, 0.02 in this run" in message and "noise: 0.1 there, 0.2 in this run" in message
    assert "rerun with --lr 0.01 and --noise 0.1, or delete the work dir" in message and str(tmp_path) in message
    with pytest.raises(ValueError, match="other settings \\(backbone: 'abc' there, 'def' in this run\\): rerun with "
                                         "the same backbone"):
        run(toy_model(), ToySettings(), path, must_match={"backbone": "def"})
    with pytest.raises(ValueError, match="init: '\\(not recorded\\)' there, 'x' in this run"):
        run(toy_model(), ToySettings(), path, must_match={"backbone": "abc", "init": "x"})  # an entry it lacks
    history, _ = run(toy_model(), ToySettings(), path, must_match={"backbone": "abc"})
    assert len(history) == 8


def test_bookkeeping_settings_may_change_on_resume(tmp_path):
    """How often the state is written changes nothing the run computes: a resumed run may change it."""
    whole, _ = run(toy_model(), ToySettings(), tmp_path / "whole.pt")
    run(toy_model(), ToySettings(), tmp_path / "split.pt", stop_after=3)
    history, _ = run(toy_model(), ToySettings(ckpt_every=1), tmp_path / "split.pt")
    assert history == whole
    assert torch.load(tmp_path / "split.pt", weights_only=False)["settings"]["ckpt_every"] == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "not a state"])
def test_a_damaged_state_file_is_named_with_how_to_start_over(tmp_path, damage):
    path = tmp_path / "state.pt"
    run(toy_model(), ToySettings(), path, stop_after=3)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint")
    else:
        torch.save({"weights": 1}, path)
    with pytest.raises(ValueError, match="truncated or corrupt") as err:
        run(toy_model(), ToySettings(), path)
    assert str(path) in str(err.value) and "delete it" in str(err.value)


def test_settings_refuse_zero_and_negative_numbers():
    for field, value in [("steps", 0), ("batch", -1), ("ckpt_every", 0), ("lr", 0.0), ("lr", float("nan")),
                         ("grad_clip", -1.0)]:
        with pytest.raises(ValueError, match=f"ToySettings.{field} must be a finite number > 0"):
            ToySettings(**{field: value})
    with pytest.raises(ValueError, match="warmup must be a finite number >= 0"):
        ToySettings(warmup=-1)
    assert ToySettings(warmup=0, weight_decay=0.0, seed=0).warmup == 0  # zero is meaningful for these


def test_group_scale_on_step_and_before_save(tmp_path):
    s = ToySettings(steps=4, ckpt_every=2)
    model = toy_model()
    opt = torch.optim.AdamW([{"params": list(model[0].parameters()), "scale": 0.25},
                             {"params": list(model[1:].parameters())}], lr=s.lr)
    seen = []

    def batch_loss(step):
        seen.append((model.training, [g["lr"] for g in opt.param_groups]))
        return model(torch.ones(2, 6)).square().mean(), step

    calls = []

    def on_step(step, record):
        model.eval()  # as a live plot that evaluates would
        calls.append(("step", step, record))

    def before_save():
        calls.append(("save",))
        if len(calls) > 4:
            raise ValueError("stop")

    with pytest.raises(ValueError, match="stop"):
        training.train_loop({"model": model}, opt, s, batch_loss, tmp_path / "state.pt", on_step=on_step,
                            before_save=before_save, progress=False)
    assert all(training_mode for training_mode, _ in seen)
    assert [lrs[0] / lrs[1] for _, lrs in seen] == pytest.approx([0.25] * 4)
    assert calls[:3] == [("step", 0, 0), ("step", 1, 1), ("save",)]
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 2  # the refused write never happened


def test_no_path_means_no_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    history, _ = run(toy_model(), ToySettings(steps=3), None)
    assert len(history) == 3 and not list(tmp_path.iterdir())
