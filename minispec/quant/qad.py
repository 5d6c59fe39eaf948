"""Quantization-aware distillation (QAD): `python -m minispec.quant.qad --recipe aggressive --steps 300`.

    teacher  the BF16 model, frozen (no gradients, eval mode)
    student  a copy PTQ'd by a recipe (fake-quant layers with the straight-through estimator)
    loss     forward KL(p_teacher ‖ p_student) of the next-token distributions at T = 1, per token,
             mean over tokens (minispec.kl.kl_divergence: the fused Triton kernel where it is dispatched)

What trains: by default only the weights of the quantized matmuls (`quant.quantized_weights`), as in "Nemotron
3.5 Super and Lightning: Open, Efficient Mixture-of-Experts Hybrid Mamba-Transformer Models for Agentic AI":
norms, biases, the embedding (unless an output head tied to it is quantized: then it is that head's weight)
and layers left in BF16 keep the teacher's values. `--train all` trains every parameter, as Model
Optimizer's QAD does by default. Quantizer scales are buffers and never train: with `scales: static` the
block scales stay as calibrated (what four-over-six and MSE need: their per-block choice is a calibration
result); with `scales: dynamic` they are recomputed from the moving weights at every forward.

No cross-entropy term (the QAD report, arXiv 2601.20088, trains on the KL alone): the student learns the
teacher's distribution, not the data. Data (`--data`): windows of the corpus' train split, or, for a chat
target, its own greedy replies to instruction prompts (`minispec.targets.replies.instruction_replies`, the
distribution QAD must keep), the KL then counted on the positions that predict a reply token. The loop is
`minispec.training.train_loop` (seeded, resumable from `<work_dir>/qad.pt`, which a run continues only with
the same settings, teacher, recipe, data and trained set). The command saves the student (`student.pt`) and
its `summary.json` in one `training.save_atomically` step into `--out`, by default
~/.cache/minispec/models/<target>-qad-<recipe> (`result_folder`), where `minispec.quant.report` looks.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from minispec import cli, distributed, training
from minispec.kl import kl_divergence
from minispec.quant.api import (
    AGGRESSIVE,
    AGGRESSIVE_HEAD_BF16,
    AGGRESSIVE_HEAD_BF16_4O6,
    AGGRESSIVE_W4A4,
    ALL_FP8,
    LIGHTNING_LIKE,
    check_recipe,
    load_recipe,
    quantize,
    quantized_weights,
)
from minispec.targets.replies import Replies

TRAINED = ("quantized", "all")  # what QAD trains: the quantized matmul weights, or every parameter
DATA = ("corpus", "replies")


@dataclass
class Settings(training.Settings):
    batch: int = 4
    lr: float = 1e-4
    seq_len: int = 64


def freeze(teacher) -> None:
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)


def make_student(teacher, recipe: dict, forward_loop=None, trained: str = "quantized"):
    """A PTQ'd deep copy of the teacher whose trainable parameters are `trained` (see TRAINED and the module doc)."""
    if trained not in TRAINED:
        raise ValueError(f"trained must be one of {TRAINED}, got {trained!r}")
    student = quantize(copy.deepcopy(teacher), recipe, forward_loop)
    chosen = {id(p) for p in quantized_weights(student).values()}
    for p in student.parameters():
        p.requires_grad_(trained == "all" or id(p) in chosen)
    return student


def qad_loss(teacher, student, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean KL(teacher ‖ student) of the next-token logits at the positions of `input_ids` [B, T]: all of them,
    or those where `mask` [B, T] is 1 (the positions that predict a reply token; padding is 0)."""
    with torch.no_grad():
        t = teacher(input_ids=input_ids).logits
    s = student(input_ids=input_ids).logits
    if mask is None:
        return kl_divergence(t.reshape(-1, t.shape[-1]), s.reshape(-1, s.shape[-1]))
    if not mask.any():
        raise ValueError("the mask selects no position: nothing to distil")
    kl = kl_divergence(t, s, reduction="none")
    return (kl * mask).sum() / mask.sum()


@torch.no_grad()
def evaluate_kl(teacher, student, windows: torch.Tensor, batch: int = 8, mask: torch.Tensor | None = None) -> float:
    """Mean per-token KL(teacher ‖ student) on fixed `[n, T]` windows (at the positions `mask` [n, T] marks)."""
    was = student.training
    student.eval()
    total = count = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i: i + batch]
        part = None if mask is None else mask[i: i + batch]
        n = chunk.numel() if part is None else part.sum().item()
        total += qad_loss(teacher, student, chunk, part).item() * n
        count += n
    student.train(was)
    return total / count


def make_optimizer(student, s: Settings) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=s.lr,
                             weight_decay=s.weight_decay, betas=(0.9, 0.95))


def train(teacher, student, batches, s: Settings, work_dir: Path | None = None, stop_after: int | None = None,
          progress: bool = True, on_step=None, must_match: dict | None = None) -> list[float]:
    """Run QAD steps 0 .. s.steps-1 (resuming from work_dir/qad.pt if it exists); returns the loss history.

    batches(step) -> [B, T] input ids, or (input ids, mask [B, T]) to count only some positions (`qad_loss`):
    the data of each step is a function of the step, so a resumed run sees exactly what an uninterrupted one
    would. on_step(step, loss) is called after each step (live plots).
    must_match: what a resumed run must share with the saved one besides its settings (the teacher, the recipe).
    """
    freeze(teacher)
    torch.manual_seed(s.seed)

    def batch_loss(step: int):
        ids, mask = batch if isinstance(batch := batches(step), tuple) else (batch, None)
        # Under torchrun each process takes its rows, and DistributedDataParallel averages the processes'
        # gradients: a shard's mean counts by its share of the batch's positions (1 without torchrun or mask).
        rows = distributed.shard_of(len(ids))
        share = 1.0 if mask is None else distributed.world_size() * float(mask[rows].sum() / mask.sum())
        loss = qad_loss(teacher, student, ids[rows], None if mask is None else mask[rows]) * share
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


def reply_batches(replies, s: Settings):
    """batches(step) -> (input ids, mask) [batch, ≤ seq_len]: seeded random rows of `replies`
    (`minispec.targets.replies.Replies`, prompt then reply) whose reply starts within seq_len tokens, cut
    after the last reply token of the batch and at seq_len; mask is 1 at the positions that predict a reply
    token (the reply's loss mask shifted by one)."""
    first = torch.where(replies.loss_mask.any(1), replies.loss_mask.argmax(1), replies.loss_mask.shape[1])
    fits = first < s.seq_len
    if not fits.any():
        raise ValueError(f"no reply starts within seq_len={s.seq_len} tokens: raise --seq-len")
    usable = Replies(replies.input_ids[fits], replies.loss_mask[fits])

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, loss_mask = usable.batch(s.batch, s.seed, step)
        width = min(s.seq_len, int(loss_mask.nonzero()[:, 1].max()) + 1)
        ids, loss_mask = ids[:, :width], loss_mask[:, :width]
        mask = torch.zeros_like(loss_mask)
        mask[:, :-1] = loss_mask[:, 1:]
        return ids, mask

    return batch


RECIPES = {"aggressive": AGGRESSIVE, "aggressive-head-bf16": AGGRESSIVE_HEAD_BF16,
           "aggressive-head-bf16-4o6": AGGRESSIVE_HEAD_BF16_4O6, "aggressive-w4a4": AGGRESSIVE_W4A4,
           "all-fp8": ALL_FP8, "lightning-like": LIGHTNING_LIKE}


def recipe_from_cli(name: str) -> dict:
    """`--recipe`: one of RECIPES by name, or a recipe .json file (checked by `load_recipe`)."""
    if name in RECIPES:
        return RECIPES[name]
    if not Path(name).is_file():
        raise ValueError(f"--recipe {name!r}: neither a named recipe {sorted(RECIPES)} nor a recipe .json file")
    return load_recipe(name)


def main(argv: list[str] | None = None) -> None:
    import minispec as ms
    from minispec.files import cache_dir
    from minispec.targets import data

    p = argparse.ArgumentParser(prog="python -m minispec.quant.qad", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="bolt-mini")
    p.add_argument("--recipe", default="aggressive", help=f"{sorted(RECIPES)} or a recipe .json file")
    p.add_argument("--scales", choices=["static", "dynamic"], help="override the recipe's scale kind")
    p.add_argument("--train", choices=TRAINED, default="quantized",
                   help="what trains: the weights of the quantized matmuls (default, as the Super/Lightning paper), "
                        "or every parameter (Model Optimizer's default)")
    p.add_argument("--data", choices=DATA, default="corpus",
                   help="corpus windows, or the target's own greedy replies to instruction prompts (a chat target)")
    p.add_argument("--replies", type=cli.positive_int, default=512, help="--data replies: how many")
    p.add_argument("--reply-len", type=cli.positive_int, default=192, help="--data replies: tokens per reply at most")
    p.add_argument("--val-windows", type=cli.positive_int, default=16,
                   help="held-out corpus windows the KL is measured on before and after")
    p.add_argument("--work-dir", type=Path, help="where the resumable state qad.pt lives (default: "
                                                 "~/.cache/minispec/train/<target>-qad-<recipe>)")
    p.add_argument("--out", type=Path, help="where student.pt and summary.json go (default: "
                                            "~/.cache/minispec/models/<target>-qad-<recipe>)")
    training.add_settings_arguments(p, Settings)
    a = p.parse_args(argv)
    s = training.settings_from_args(p, a, Settings())
    recipe = recipe_from_cli(a.recipe)
    if a.scales:
        recipe = check_recipe(dict(recipe, scales=a.scales))
    name = f"{Path(a.target).name}-qad-{recipe['name']}"
    work_dir = a.work_dir or cache_dir() / "train" / name
    out = a.out or result_folder(a.target, recipe["name"])
    t0 = time.time()
    teacher, tok = ms.load_target(a.target)
    calib = data.random_windows(data.token_stream("train", tok), 8, s.seq_len, s.seed, -1)
    student = make_student(teacher, recipe, lambda m: m(input_ids=calib), a.train)
    if a.data == "replies":
        from minispec.targets.replies import instruction_replies

        batches = reply_batches(instruction_replies(teacher, tok, a.replies, a.reply_len), s)
    else:
        batches = corpus_batches(tok, s)
    val = data.random_windows(data.token_stream("val", tok), a.val_windows, s.seq_len, s.seed, -2)
    before = evaluate_kl(teacher, student, val)
    data_key = {"data": a.data} if a.data == "corpus" else {"data": a.data, "replies": a.replies,
                                                             "reply_len": a.reply_len}
    history = train(teacher, student, batches, s, work_dir,
                    must_match={"teacher": training.weights_digest(teacher), "recipe": recipe, "train": a.train,
                                **data_key})
    after = evaluate_kl(teacher, student, val)
    n = min(20, len(history))  # fewer when the run has fewer steps
    summary = {"recipe": recipe["name"], "scales": recipe["scales"], "train": a.train, **data_key,
               "trained_params": sum(p.numel() for p in student.parameters() if p.requires_grad),
               "params": sum(p.numel() for p in student.parameters()), "settings": asdict(s),
               "val_kl_ptq": before, "val_kl_qad": after,
               "train_kl_first_20": sum(history[:n]) / n, "train_kl_last_20": sum(history[-n:]) / n,
               "train_kl_steps_averaged": n, "seconds_this_run": time.time() - t0,
               "command": "python -m minispec.quant.qad " + " ".join(sys.argv[1:] if argv is None else argv)}

    def write(folder: Path) -> None:
        torch.save(student.state_dict(), folder / "student.pt")
        (folder / "summary.json").write_text(json.dumps(summary, indent=1))

    training.save_atomically(out, write)
    if distributed.is_main():
        print(json.dumps(summary, indent=1))
        print(f"saved {out}; `python -m minispec.quant.report` reads its student.pt")


if __name__ == "__main__":
    main()
