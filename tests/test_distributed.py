"""Data-parallel training (minispec.distributed, through minispec.training.train_loop): a DFlash drafter
trained by two processes under torchrun (gloo, CPU), each on its half of every batch, takes the same steps as
one process on the whole batch, and the state it leaves resumes in one process to the same weights as an
uninterrupted single-process run. A QAD step, the same scaffold, also matches.

This file is also the worker torchrun starts: `python -m torch.distributed.run --nproc_per_node=2
tests/test_distributed.py TARGET WORK_DIR` trains steps 0 and 1 of 3 (then stops, as an interruption would), and
one QAD step."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the torchrun worker imports tiny.py as the tests do

from minispec import distributed, quant
from minispec.dflash.config import DFlashConfig
from minispec.dflash.model import DFlashDraftModel
from minispec.dflash.train import Settings, train
from minispec.quant import qad
from minispec.targets.load import load_target
from tiny import save_with_tokenizer, tiny_gemma

MASK_ID = 3


def new_drafter(target):
    torch.manual_seed(1)
    cfg = DFlashConfig.for_target(target.config, [1, 2], MASK_ID, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  layer_types=["sliding_attention"], sliding_window=16, block_size=8)
    return DFlashDraftModel.for_target(cfg, target)


def stream(n=400, period=37):
    g = torch.Generator().manual_seed(0)
    return (4 + 100 * torch.randint(0, 8, (period,), generator=g)).repeat(n // period + 1)[:n]


# batch 4 is the global batch: 2 rows per process under two processes. lr small enough that Adam's first
# step (about lr * sign(gradient)) keeps float-rounding differences of the gradients small.
SETTINGS = Settings(steps=3, batch=4, seq_len=32, num_anchors=4, lr=1e-3, warmup=1, ckpt_every=1, distill=0.0)


def run(target_folder, work_dir, stop_after=None, rows_seen=None):
    """Train (or resume) the test drafter; `rows_seen` collects the batch rows of each drafter forward."""
    target = load_target(target_folder)[0]
    drafter = new_drafter(target)
    if rows_seen is not None:
        drafter.register_forward_pre_hook(lambda module, args: rows_seen.append(len(args[0])))
    train(drafter, target, stream(), SETTINGS, work_dir, stop_after=stop_after, desc="ddp test")
    return drafter


QAD_SETTINGS = qad.Settings(steps=1, batch=4, seq_len=16, lr=5e-4, warmup=1)


def run_qad(work_dir):
    """One QAD step of a tiny student: the same scaffold, so the same data parallelism."""
    teacher = tiny_gemma(layers=2, seed=5)
    student = qad.make_student(teacher, quant.AGGRESSIVE)

    def batches(step):
        return torch.randint(4, 4096, (QAD_SETTINGS.batch, 16), generator=torch.Generator().manual_seed(1000 + step))

    qad.train(teacher, student, batches, QAD_SETTINGS, work_dir, progress=False)


def saved_weights(work_dir, file="train_state.pt", name="model"):
    return torch.load(Path(work_dir) / file, weights_only=False)[name]


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_two_processes_take_the_one_process_step_and_resume_in_one(tmp_path):
    folder = save_with_tokenizer(tiny_gemma(layers=4, window=16, seed=0), tmp_path / "target")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           __file__, str(folder), str(tmp_path / "ddp")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert distributed.world_size() == 1  # this process is not part of the group

    run(folder, tmp_path / "one", stop_after=2)
    assert_same_weights(saved_weights(tmp_path / "ddp"), saved_weights(tmp_path / "one"))
    run_qad(tmp_path / "qad-one")
    assert_same_weights(saved_weights(tmp_path / "qad-ddp", "qad.pt", "student"),
                        saved_weights(tmp_path / "qad-one", "qad.pt", "student"))

    # The state two processes left resumes in one, to the weights of an uninterrupted one-process run.
    resumed = run(folder, tmp_path / "ddp")
    whole = run(folder, tmp_path / "whole")
    assert_same_weights(resumed.state_dict(), whole.state_dict())
    # The history holds the whole batch's numbers, whatever the number of processes that computed them.
    history, reference = (torch.load(tmp_path / d / "train_state.pt", weights_only=False)["history"]
                          for d in ("ddp", "whole"))
    for record, expected in zip(history[:2], reference):
        assert record == pytest.approx(expected, rel=1e-4)


def test_a_batch_that_does_not_split_is_refused(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert distributed.shard_of(8) == slice(2, 4)
    with pytest.raises(ValueError, match="6 rows does not split evenly over 4 processes"):
        distributed.shard_of(6)


if __name__ == "__main__":
    torch.set_num_threads(1)
    assert distributed.world_size() == 2, "run under torchrun --nproc_per_node=2"
    rows = []
    run(sys.argv[1], sys.argv[2], stop_after=2, rows_seen=rows)
    assert rows == [SETTINGS.batch // 2] * 2, f"each process computes its half of the batch, not {rows} rows"
    run_qad(Path(sys.argv[2]).parent / "qad-ddp")
