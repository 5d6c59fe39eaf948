"""Quantization-aware distillation (QAD): `python -m minispec.quant.qad --recipe aggressive --steps 300`.

    teacher  the BF16 model, frozen (no gradients, eval mode)
    student  a copy PTQ'd by a recipe (fake-quant layers with the straight-through estimator)
    loss     forward KL(p_teacher ‖ p_student) of the next-token distributions at T = 1, per token,
             mean over tokens (minispec.kl.kl_divergence: the fused Triton kernel where it is dispatched)

Every student parameter trains; quantizer scales are buffers and do not (as in Model Optimizer's QAD).
With `scales: static` the block scales stay as calibrated (what four-over-six and MSE need: their
per-block choice is a calibration result); with `scales: dynamic` they are recomputed from the moving
weights at every forward. No cross-entropy term (the QAD report, arXiv 2601.20088, trains on the KL
alone): the student learns the teacher's distribution, not the corpus. Data are windows of the corpus'
train split; the loop is `minispec.training.train_loop` (seeded, resumable from `<work_dir>/qad.pt`, which
a run continues only with the same settings, teacher and recipe). The command saves the student
(`student.pt`) and its `summary.json` in one `training.save_atomically` step into `--out`, by default
~/.cache/minispec/models/<target>-qad-<recipe> (`result_folder`), where `minispec.quant.report` looks.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from minispec import training
from minispec.kl import kl_divergence
from minispec.quant.api import AGGRESSIVE, AGGRESSIVE_W4A4, LIGHTNING_LIKE, check_recipe, load_recipe, quantize


@dataclass
class Settings(training.Settings):
    batch: int = 4
    lr: float = 1e-4
    seq_len: int = 64


def freeze(teacher) -> None:
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)


def make_student(teacher, recipe: dict, forward_loop=None):
    """A PTQ'd deep copy of the teacher with every parameter trainable."""
    student = quantize(copy.deepcopy(teacher), recipe, forward_loop)
    for p in student.parameters():
        p.requires_grad_(True)
    return student


def qad_loss(teacher, student, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of `input_ids` [B, T] of KL(teacher ‖ student) on their next-token logits."""
    with torch.no_grad():
        t = teacher(input_ids=input_ids).logits
    s = student(input_ids=input_ids).logits
    return kl_divergence(t.reshape(-1, t.shape[-1]), s.reshape(-1, s.shape[-1]))


@torch.no_grad()
def evaluate_kl(teacher, student, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean per-token KL(teacher ‖ student) on fixed `[n, T]` windows."""
    was = student.training
    student.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i: i + batch]
        total += qad_loss(teacher, student, chunk).item() * len(chunk)
    student.train(was)
    return total / len(windows)


def make_optimizer(student, s: Settings) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=s.lr,
                             weight_decay=s.weight_decay, betas=(0.9, 0.95))


def train(teacher, student, batches, s: Settings, work_dir: Path | None = None, stop_after: int | None = None,
          progress: bool = True, on_step=None, must_match: dict | None = None) -> list[float]:
    """Run QAD steps 0 .. s.steps-1 (resuming from work_dir/qad.pt if it exists); returns the loss history.

    batches(step) -> [B, T] input ids: the data of each step is a function of the step, so a resumed run
    sees exactly what an uninterrupted one would. on_step(step, loss) is called after each step (live plots).
    must_match: what a resumed run must share with the saved one besides its settings (the teacher, the recipe).
    """
    freeze(teacher)
    torch.manual_seed(s.seed)

    def batch_loss(step: int):
        loss = qad_loss(teacher, student, batches(step))
        return loss, loss.item()

    return training.train_loop({"student": student}, make_optimizer(student, s), s, batch_loss,
                               None if work_dir is None else Path(work_dir) / "qad.pt", stop_after=stop_after,
                               on_step=on_step, desc="QAD", progress=progress, must_match=must_match)


def result_folder(target: str, recipe_name: str) -> Path:
    """Where the command saves a QAD run of `target` (a shipped name or a folder) with recipe `recipe_name`."""
    return training.default_out(f"{Path(target).name}-qad-{recipe_name}")


def corpus_batches(tokenizer, s: Settings, split: str = "train"):
    """batches(step) -> seeded random [batch, seq_len] windows of a corpus split."""
    from minispec.targets import data

    stream = data.token_stream(split, tokenizer)
    return lambda step: data.random_windows(stream, s.batch, s.seq_len, s.seed, step)


RECIPES = {"aggressive": AGGRESSIVE, "aggressive-w4a4": AGGRESSIVE_W4A4, "lightning-like": LIGHTNING_LIKE}


def main(argv: list[str] | None = None) -> None:
    import minispec as ms
    from minispec.targets import data

    p = argparse.ArgumentParser(prog="python -m minispec.quant.qad", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="bolt-mini")
    p.add_argument("--recipe", default="aggressive", help=f"{sorted(RECIPES)} or a recipe .json file")
    p.add_argument("--scales", choices=["static", "dynamic"], help="override the recipe's scale kind")
    p.add_argument("--work-dir", type=Path, help="where the resumable state qad.pt lives (default: "
                                                 "~/.cache/minispec/train/<target>-qad-<recipe>)")
    p.add_argument("--out", type=Path, help="where student.pt and summary.json go (default: "
                                            "~/.cache/minispec/models/<target>-qad-<recipe>)")
    training.add_settings_arguments(p, Settings)
    a = p.parse_args(argv)
    s = training.settings_from_args(p, a, Settings())
    recipe = RECIPES[a.recipe] if a.recipe in RECIPES else load_recipe(a.recipe)
    if a.scales:
        recipe = check_recipe(dict(recipe, scales=a.scales))
    name = f"{Path(a.target).name}-qad-{recipe['name']}"
    work_dir = a.work_dir or data.cache_dir() / "train" / name
    out = a.out or result_folder(a.target, recipe["name"])
    teacher, tok = ms.load_target(a.target)
    calib = data.random_windows(data.token_stream("train", tok), 8, s.seq_len, s.seed, -1)
    student = make_student(teacher, recipe, lambda m: m(input_ids=calib))
    val = data.random_windows(data.token_stream("val", tok), 16, s.seq_len, s.seed, -2)
    before = evaluate_kl(teacher, student, val)
    history = train(teacher, student, corpus_batches(tok, s), s, work_dir,
                    must_match={"teacher": training.weights_digest(teacher), "recipe": recipe})
    after = evaluate_kl(teacher, student, val)
    n = min(20, len(history))  # fewer when the run has fewer steps
    summary = {"recipe": recipe["name"], "scales": recipe["scales"], "settings": asdict(s),
               "val_kl_ptq": before, "val_kl_qad": after,
               "train_kl_first_20": sum(history[:n]) / n, "train_kl_last_20": sum(history[-n:]) / n,
               "train_kl_steps_averaged": n,
               "command": "python -m minispec.quant.qad " + " ".join(sys.argv[1:] if argv is None else argv)}

    def write(folder: Path) -> None:
        torch.save(student.state_dict(), folder / "student.pt")
        (folder / "summary.json").write_text(json.dumps(summary, indent=1))

    training.save_atomically(out, write)
    print(json.dumps(summary, indent=1))
    print(f"saved {out}; `python -m minispec.quant.report` reads its student.pt")


if __name__ == "__main__":
    main()
