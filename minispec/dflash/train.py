"""Train a DFlash drafter for a shipped target on CPU: `python -m minispec.dflash.train --target bolt-mini`.

One step (the recipe of SpecForge's `train_dflash.py` and Model Optimizer's DFlash trainer; z-lab has
not published its own):

    x        = a seeded batch of training windows                      (same batch for the same (seed, step))
    F, p_t   = ONE frozen target forward: tap features (and its logits for distillation)
    anchors  = re-sampled every step from a generator seeded by (seed, step)
    logits   = ONE drafter forward over all blocks, with the training mask (`DFlashDraftModel.forward`)
    loss     = (1 - distill) * weighted CE(x[a + k]) + distill * weighted soft CE against the target's
               distribution for token a + k (read at position a + k - 1); the anchor has no loss

Only the drafter's own weights train: the target (whose embedding, and head unless the drafter has its
own, the drafter borrows) is frozen and never handed to the optimizer. The loop is
`minispec.training.train_loop`: seeded, resumable from `train_state.pt` in the work dir.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from minispec import training
from minispec.dflash import mask as dmask
from minispec.dflash.config import bolt_mini_dflash_config
from minispec.dflash.model import DFlashDraftModel, num_parameters
from minispec.targets import corpus, data
from minispec.targets.load import CHECKPOINTS, load_target
from minispec.targets.replies import Replies, generate_replies


@dataclass
class Settings(training.Settings):
    steps: int = 600
    warmup: int = 20
    weight_decay: float = 0.01
    seq_len: int = 512  # window length when training on a token stream instead of replies
    # Training data: the target's own replies to train-split prompts (SpecForge and Model Optimizer
    # regenerate the responses with the target), greedy ones for T = 0 and sampled ones for T > 0.
    greedy_replies: int = 1024
    sampled_replies: int = 512
    prompt_len: int = 64
    reply_len: int = 256
    num_anchors: int = 64  # blocks per sequence per step
    gamma: float = 4.0  # loss decay exp(-(k-1)/gamma); 4 for B = 8
    distill: float = 0.5  # weight of the soft-label loss against the target (0: hard labels only)
    eval_replies: int = 32  # greedy replies to val-split prompts


# Per-target defaults; any field can be overridden on the command line.
SETTINGS = {"bolt-mini": Settings()}
CONFIGS = {"bolt-mini": bolt_mini_dflash_config}


def freeze(target) -> None:
    """The target is fixed: no gradients into it, nor into the embedding / head the drafter borrows."""
    target.eval()
    target.requires_grad_(False)


def batch_at(dataset: torch.Tensor | Replies, s: Settings, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch (x [Bs, S], loss_mask [Bs, S]): rows of `Replies` (loss on reply tokens only),
    or windows of a token stream (loss everywhere). Seeded by (seed, step), so resuming is exact."""
    if isinstance(dataset, Replies):
        return dataset.batch(s.batch, s.seed, step)
    x = data.random_windows(dataset, s.batch, s.seq_len, s.seed, step)
    return x, torch.ones_like(x)


def sample_blocks(x: torch.Tensor, loss_mask: torch.Tensor, drafter: DFlashDraftModel, s: Settings,
                  step: int) -> dmask.Blocks:
    """This step's anchors (seeded by (seed, step), so a resumed run draws the same ones) and their blocks."""
    g = torch.Generator().manual_seed(s.seed * 1_000_003 + step + 500_009)
    T = drafter.config.block_size
    anchors, valid = dmask.sample_anchors(loss_mask, T, s.num_anchors, g)
    return dmask.make_blocks(x, anchors, valid, T, drafter.config.mask_token_id, loss_mask=loss_mask, gamma=s.gamma)


def soft_loss(logits: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * CE(softmax(teacher), logits)) / sum(w): the soft-label version of `mask.dflash_loss`."""
    ce = -(teacher.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)
    w = weights.to(ce.dtype)
    return (w * ce).sum() / w.sum().clamp(min=torch.finfo(ce.dtype).tiny)


def teacher_logits(target_logits: torch.Tensor, blocks: dmask.Blocks) -> torch.Tensor:
    """[Bs, S, V] target logits -> [Bs, N, T, V]: token a + k is predicted at position a + k - 1."""
    S, V = target_logits.shape[1:]
    index = (blocks.positions - 1).clamp(0, S - 1).flatten(1)  # k = 0 has weight 0; clamped past the end
    return target_logits.gather(1, index[..., None].expand(-1, -1, V)).view(*blocks.positions.shape, V)


def step_loss(drafter: DFlashDraftModel, target, x: torch.Tensor, loss_mask: torch.Tensor, s: Settings, step: int):
    """(loss, weighted accuracy) of one batch x [Bs, S] whose tokens with loss_mask = 1 carry loss."""
    with torch.no_grad():
        out = target(input_ids=x, output_hidden_states=True)
    blocks = sample_blocks(x, loss_mask, drafter, s, step)
    logits = drafter(drafter.tap(out.hidden_states), blocks)  # [Bs, N, T, V]
    loss = dmask.dflash_loss(logits, blocks.labels, blocks.weights) if s.distill < 1 else 0.0
    if s.distill > 0:
        soft = soft_loss(logits, teacher_logits(out.logits, blocks), blocks.weights)
        loss = (1 - s.distill) * loss + s.distill * soft
    return loss, dmask.weighted_accuracy(logits.detach(), blocks.labels, blocks.weights)


@torch.no_grad()
def evaluate(drafter: DFlashDraftModel, target, windows: torch.Tensor | Replies, s: Settings) -> dict[str, float]:
    """Mean loss and weighted accuracy over `[n, L]` windows (loss everywhere) or `Replies`, with fixed
    anchors (step -1's)."""
    drafter.eval()
    if not isinstance(windows, Replies):
        windows = Replies(windows, torch.ones_like(windows))
    losses, accs = [], []
    for i in range(0, len(windows), s.batch):
        x, loss_mask = windows.input_ids[i: i + s.batch], windows.loss_mask[i: i + s.batch]
        loss, acc = step_loss(drafter, target, x, loss_mask, s, step=-1)
        losses.append(float(loss))
        accs.append(acc)
    return {"loss": sum(losses) / len(losses), "accuracy": sum(accs) / len(accs)}


def make_optimizer(drafter: DFlashDraftModel, s: Settings) -> torch.optim.AdamW:
    params = [p for p in drafter.parameters() if p.requires_grad]  # the drafter's own weights only
    return training.adamw(params, s)


def train(drafter: DFlashDraftModel, target, dataset: torch.Tensor | Replies, s: Settings, work_dir: Path,
          stop_after: int | None = None, desc: str = "train dflash", on_step=None) -> list[dict]:
    """Train `drafter` (attached to `target`) in place on `dataset`: the target's `Replies` (loss on the
    reply tokens), or windows of a token stream [n].

    Resumes from `work_dir/train_state.pt`. `stop_after` ends the run early (after that step count,
    with a checkpoint), as an interruption would. `on_step(step, record)` is called after every step
    (a notebook's live plot hooks in here). Returns the history: per step {"loss", "accuracy"}.
    """
    freeze(target)
    drafter.attach_target(target)

    def batch_loss(step: int):
        x, loss_mask = batch_at(dataset, s, step)
        loss, acc = step_loss(drafter, target, x, loss_mask, s, step)
        return loss, {"loss": loss.item(), "accuracy": acc}

    return training.train_loop({"model": drafter}, make_optimizer(drafter, s), s, batch_loss,
                               Path(work_dir) / "train_state.pt", stop_after=stop_after, on_step=on_step, desc=desc)


def training_replies(target, tokenizer, s: Settings) -> Replies:
    """The target's greedy and sampled (T = 1) replies to train-split prompts, cached on disk."""
    parts = [generate_replies(target, tokenizer, n, s.prompt_len, s.reply_len, temperature, seed=s.seed + i)
             for i, (n, temperature) in enumerate([(s.greedy_replies, 0.0), (s.sampled_replies, 1.0)]) if n]
    return Replies(torch.cat([p.input_ids for p in parts]), torch.cat([p.loss_mask for p in parts]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="bolt-mini", choices=sorted(CONFIGS))
    p.add_argument("--out", type=Path, help="output folder (default: minispec/checkpoints/<target>-dflash)")
    p.add_argument("--work-dir", type=Path, help="where resumable train state lives")
    p.add_argument("--init-from", type=Path, help="start from this saved drafter's weights (a second stage)")
    for field, default in asdict(Settings()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), help=f"default: per target ({default})")
    a = p.parse_args(argv)
    overrides = {k: getattr(a, k) for k in asdict(Settings()) if getattr(a, k) is not None}
    s = Settings(**(asdict(SETTINGS[a.target]) | overrides))
    out = a.out or CHECKPOINTS / f"{a.target}-dflash"
    work_dir = a.work_dir or data.cache_dir() / "train" / f"{a.target}-dflash"

    target, tok = load_target(a.target)
    torch.manual_seed(s.seed)
    drafter = DFlashDraftModel.for_target(CONFIGS[a.target](), target)
    previous = None
    if a.init_from is not None:
        start = DFlashDraftModel.from_pretrained(a.init_from)
        drafter.load_state_dict({k: v.to(drafter.dtype) for k, v in start.state_dict().items()})
        previous = json.loads((a.init_from / "training.json").read_text())
    history = train(drafter, target, training_replies(target, tok, s), s, work_dir)
    val = generate_replies(target, tok, s.eval_replies, s.prompt_len, s.reply_len, 0.0, split="val", seed=s.seed)
    metrics = evaluate(drafter, target, val, s)
    out.mkdir(parents=True, exist_ok=True)
    drafter.to(torch.bfloat16).save_pretrained(out)  # bf16 on disk, like every shipped checkpoint
    recent = history[-100:]
    record = {
        "command": "python -m minispec.dflash.train " + shlex.join(sys.argv[1:] if argv is None else argv),
        "target": a.target,
        "settings": asdict(s),
        "train_data_sha256": corpus.data_hash(corpus.iter_files("train")),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "parameters": num_parameters(drafter),
        "final_train_loss_avg100": sum(h["loss"] for h in recent) / len(recent),
        "final_train_accuracy_avg100": sum(h["accuracy"] for h in recent) / len(recent),
        "val_loss": metrics["loss"],
        "val_weighted_accuracy": metrics["accuracy"],
        "val_data": f"{len(val)} greedy replies of {s.reply_len} tokens to {s.prompt_len}-token val-split prompts",
        "loss_history_every_10": [h["loss"] for h in history[::10]],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "previous_stage": previous,  # the run this one started from (--init-from), or None
    }
    (out / "training.json").write_text(json.dumps(record, indent=1))
    print(f"val loss {metrics['loss']:.4f}  weighted accuracy {metrics['accuracy']:.4f}  -> {out}")


if __name__ == "__main__":
    main()
