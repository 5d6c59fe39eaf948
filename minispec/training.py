"""The one training scaffold: every trainer in the package (targets, DFlash, MTP stages and boosting, QAD)
supplies its data and its loss as `batch_loss(step)`, and `train_loop` runs the same loop for all:

    for step in start .. steps-1:
        lr             = lr_at(step)                      linear warmup, then cosine decay to min_lr_ratio * lr
        loss, record   = batch_loss(step)                 the batch of step s depends only on (seed, s)
        loss.backward(); clip the gradient norm to grad_clip; optimizer step; zero the gradients
        history       += [record]
        every ckpt_every steps, and at the end: write the resumable state atomically

The state file holds the modules' and the optimizer's state dicts, the step reached, the history and the
settings. A rerun of the same command continues from it, and because every batch (and every random draw
of the loss) is a function of (seed, step), a resumed run ends bit-identical to an uninterrupted one. It
resumes only with the same settings (and the same `must_match` entries, e.g. the weights digest of a
frozen model the run trains against): a changed learning rate or step count would silently make a
different model.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm


@dataclass
class Settings:
    """The fields every trainer has. Each trainer subclasses this, adds its own fields and overrides the
    defaults it needs (its recorded settings are `asdict` of the subclass)."""
    steps: int = 300
    batch: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 50


def lr_at(step: int, s: Settings) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def weight_decay_groups(params, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on matrices (dim >= 2), none on norms, biases and gains."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def adamw(params, s: Settings) -> torch.optim.AdamW:
    """AdamW with betas (0.9, 0.95), as the trainers of pretrained models here use, over `weight_decay_groups`."""
    return torch.optim.AdamW(weight_decay_groups(params, s.weight_decay), lr=s.lr, betas=(0.9, 0.95))


def weights_digest(model: torch.nn.Module) -> str:
    """A short hash of every tensor of `model`: names a model's weights in cache keys and resume checks."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def load_state(path: Path, modules: dict, settings: dict, must_match: dict) -> tuple[int, list]:
    """Load `path` into `modules` ({name: module or optimizer}) if it exists: (start step, history)."""
    if not path.exists():
        return 0, []
    state = torch.load(path, weights_only=False)
    if state["settings"] != settings:
        raise ValueError(f"{path} was written with other settings: {state['settings']}; "
                         "delete it or rerun with the same settings")
    for key, value in must_match.items():
        if state.get(key) != value:
            raise ValueError(f"{path} was written against another {key} ({key} {state.get(key)!r}, this run's "
                             f"{value!r}); delete it or rerun against the same {key}")
    for name, module in modules.items():
        module.load_state_dict(state[name])
    return state["step"], state["history"]


def save_state(path: Path, modules: dict, step: int, history: list, settings: dict, must_match: dict) -> None:
    """Write the state atomically: a crash mid-write leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: m.state_dict() for name, m in modules.items()}
    torch.save({**state, **must_match, "step": step, "history": history, "settings": settings},
               path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def running_means(history: list, window: int = 20) -> dict[str, str]:
    """The progress bar's numbers: the mean of each number in the last `window` records."""
    rows = [r if isinstance(r, dict) else {"loss": r} for r in history[-window:]]
    return {k: f"{sum(r[k] for r in rows) / len(rows):.4f}" for k, v in rows[-1].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def train_loop(modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer, s: Settings,
               batch_loss: Callable[[int], tuple[torch.Tensor, object]], path: Path | None,
               stop_after: int | None = None, on_step: Callable | None = None, desc: str = "train",
               progress: bool = True, before_save: Callable[[], None] | None = None,
               must_match: dict | None = None) -> list:
    """Train `modules` ({name: module}, the optimizer's parameters among them; in train mode while training,
    eval mode after) for steps 0 .. s.steps-1; returns the history (one `record` per step). See the module doc.

    batch_loss(step) -> (loss, record): the 0-d loss of step `step`'s batch and what the history keeps of
        it (a float, or a dict of numbers and lists). A parameter group's optional "scale" multiplies its
        learning rate (a pretrained backbone fine-tuned slower than a fresh head).
    path: the resumable state (`None`: no checkpoints). `stop_after` ends the run early, with a checkpoint,
        as an interruption would. `on_step(step, record)` runs after every step (a notebook's live plot
        hooks in here). `before_save()` runs before every checkpoint write and may raise to stop the run.
        `must_match` entries are stored with the state, and a resumed run must bring the same ones.
    """
    path = None if path is None else Path(path)
    must_match = must_match or {}
    state_modules = {**modules, "optimizer": optimizer}
    settings = asdict(s)
    start, history = load_state(path, state_modules, settings, must_match) if path is not None else (0, [])
    if start:
        print(f"{desc}: resuming from step {start}")
    end = s.steps if stop_after is None else min(s.steps, stop_after)
    params = [p for m in modules.values() for p in m.parameters()]
    for m in modules.values():
        m.train()
    bar = tqdm(range(start, end), initial=start, total=s.steps, desc=desc, disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s) * group.get("scale", 1.0)
        loss, record = batch_loss(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(record)
        if on_step is not None:
            on_step(step, record)
            for m in modules.values():
                m.train()  # the hook may have evaluated them
        bar.set_postfix(running_means(history))
        if path is not None and ((step + 1) % s.ckpt_every == 0 or step + 1 == end):
            if before_save is not None:
                before_save()
            save_state(path, state_modules, step + 1, history, settings, must_match)
    for m in modules.values():
        m.eval()
    return history
