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
resumes only with the same settings (and the same `must_match` entries: the weights digest of a frozen
model the run trains against, the weights it started from): a changed learning rate or step count would
silently make a different model. Settings that only change the bookkeeping (`Settings.BOOKKEEPING`: how
often the state is written, how much is evaluated at the end) may change on resume.

A finished model is written with `save_atomically`: everything goes into a temporary sibling folder, which
replaces the model's folder by a rename only once the whole folder (weights, config, tokenizer,
training.json, SHA256SUMS) is written. A run that fails at any point before leaves the previous model as it was.

Under `torchrun --nproc_per_node=N` the same loop trains on N processes (`minispec.distributed`): the trained
modules are wrapped in DistributedDataParallel, each process computes the loss of its shard of the step's batch
(`batch_loss` takes its rows with `distributed.shard`), the gradients are averaged over the processes before the
clipping and the step, the records are averaged too, and rank 0 alone writes the state and the models.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from tqdm import tqdm

from minispec import cli, distributed
from minispec.files import cache_dir
from minispec.manifest import write_manifest


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

    # Fields that change only how often the state is written or how much is measured at the end, not what the
    # run computes: a resumed run may change them. A subclass extends the set with its own.
    BOOKKEEPING: ClassVar[frozenset[str]] = frozenset({"ckpt_every"})
    # Number fields for which 0 is meaningful ("no warmup", "no weight decay"); every other must be > 0.
    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset({"warmup", "seed", "weight_decay", "min_lr_ratio"})

    def __post_init__(self):
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            low = 0 if name in self.ZERO_ALLOWED else None
            if not math.isfinite(value) or value < 0 or (value == 0 and low is None):
                rule = ">= 0" if low == 0 else "> 0"
                raise ValueError(f"{type(self).__name__}.{name} must be a finite number {rule}, got {value}")


def parse_bool(text: str) -> bool:
    """A command-line boolean: true / false / 1 / 0."""
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[Settings], help: str = "default: {}") -> None:
    """One `--flag` per field of `cls`, default None (the trainer's per-model default then applies), typed with
    `minispec.cli`'s argument types so that 0 or a negative count is refused while the arguments are parsed."""
    for name, default in asdict(cls()).items():
        if isinstance(default, bool):
            kind = parse_bool
        elif isinstance(default, int):
            kind = cli.non_negative_int if name in cls.ZERO_ALLOWED else cli.positive_int
        elif isinstance(default, float):
            kind = cli.non_negative_float if name in cls.ZERO_ALLOWED else cli.positive_float
        else:
            kind = type(default)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, help=help.format(default))


def settings_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, defaults: Settings) -> Settings:
    """`defaults` with the fields given on the command line replaced; a combination the settings refuse
    (e.g. no training replies at all) stops the parser with its message."""
    overrides = {k: getattr(args, k) for k in asdict(defaults) if getattr(args, k) is not None}
    try:
        return type(defaults)(**(asdict(defaults) | overrides))
    except ValueError as e:
        parser.error(str(e))


def default_out(name: str) -> Path:
    """Where a trainer saves model `name` unless `--out` names a folder: the user cache (`$MINISPEC_CACHE`,
    else ~/.cache/minispec) under models/, never the installed package."""
    return cache_dir() / "models" / name


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


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_state(path: Path, modules: dict, settings: dict, must_match: dict,
               bookkeeping: frozenset[str] = frozenset()) -> tuple[int, list]:
    """Load `path` into `modules` ({name: module or optimizer}) if it exists: (start step, history).

    The saved run's settings and `must_match` entries must equal this run's, except the `bookkeeping` fields;
    the error names every one that differs, the flag that restores it, and the work dir to delete instead."""
    if not path.exists():
        return 0, []
    try:
        state = torch.load(path, weights_only=False)
        saved = {k: v for k, v in state["settings"].items() if k not in bookkeeping}
        recorded = state.get("must_match", state)  # states written before it had a key of its own: top level
        saved |= {k: recorded.get(k, "(not recorded)") for k in must_match}
        step, history = state["step"], state["history"]
    except Exception as e:  # EOFError (truncated), RuntimeError (not a zip), KeyError (not a state): all say damaged
        raise ValueError(f"{path} cannot be read, it is truncated or corrupt ({type(e).__name__}: {e}); delete it, "
                         f"or its work dir {path.parent}, to start the run over") from e
    now = {k: v for k, v in settings.items() if k not in bookkeeping} | must_match
    differ = [k for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)]
    if differ:
        changes = "; ".join(f"{k}: {_shown(saved.get(k))} there, {_shown(now.get(k))} in this run" for k in differ)
        restore = [f"--{k.replace('_', '-')} {saved[k]}" for k in differ if k in settings and k in saved]
        restore += [f"the same {k}" for k in differ if k in must_match]
        raise ValueError(f"{path} was written by a run with other settings ({changes}): rerun with "
                         f"{' and '.join(restore) or 'what the saved run used'}, or delete the work dir {path.parent} "
                         "to start a new run")
    try:
        for name, module in modules.items():
            module.load_state_dict(state[name])
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"{path} does not fit this run's model ({type(e).__name__}: {str(e)[:200]}); delete it, "
                         f"or its work dir {path.parent}, to start the run over") from e
    return step, history


def save_state(path: Path, modules: dict, step: int, history: list, settings: dict, must_match: dict) -> None:
    """Write the state atomically: a crash mid-write leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: m.state_dict() for name, m in modules.items()}
    torch.save({**state, "must_match": must_match, "step": step, "history": history, "settings": settings},
               path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def running_means(history: list, window: int = 20) -> dict[str, str]:
    """The progress bar's numbers: the mean of each number every one of the last `window` records has (a hook
    may add an occasional evaluation to a record: that is not a running number)."""
    rows = [r if isinstance(r, dict) else {"loss": r} for r in history[-window:]]
    return {k: f"{sum(r[k] for r in rows) / len(rows):.4f}" for k, v in rows[-1].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and all(k in r for r in rows)}


class Step(torch.nn.Module):
    """One step's loss as a module's forward, `batch_loss(step)` over `modules`: the unit DistributedDataParallel
    wraps, whatever modules the trainer's loss calls and however it calls them. Its parameters are theirs."""

    def __init__(self, modules: dict[str, torch.nn.Module], batch_loss: Callable[[int], tuple[torch.Tensor, object]]):
        super().__init__()
        self.trained = torch.nn.ModuleDict(modules)
        self.batch_loss = batch_loss

    def forward(self, step: int):
        return self.batch_loss(step)


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
    distributed.shard_of(s.batch)  # refuses a batch that does not split over the processes, before any work
    start, history = (0, []) if path is None else load_state(path, state_modules, settings, must_match,
                                                             type(s).BOOKKEEPING)
    if start and distributed.is_main():
        print(f"{desc}: resuming from step {start}")
    end = s.steps if stop_after is None else min(s.steps, stop_after)
    params = [p for m in modules.values() for p in m.parameters()]
    step_loss = Step(modules, batch_loss)
    if distributed.world_size() > 1:
        step_loss = torch.nn.parallel.DistributedDataParallel(step_loss)
    for m in modules.values():
        m.train()
    bar = tqdm(range(start, end), initial=start, total=s.steps, desc=desc,
               disable=not progress or not distributed.is_main())
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s) * group.get("scale", 1.0)
        loss, record = step_loss(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record = distributed.mean_over_processes(record)
        history.append(record)
        if on_step is not None:
            on_step(step, record)
            for m in modules.values():
                m.train()  # the hook may have evaluated them
        bar.set_postfix(running_means(history))
        if path is not None and ((step + 1) % s.ckpt_every == 0 or step + 1 == end):
            if before_save is not None:
                before_save()
            if distributed.is_main():
                save_state(path, state_modules, step + 1, history, settings, must_match)
            distributed.barrier()  # no process runs ahead of a state that another could resume from
    for m in modules.values():
        m.eval()
    return history


def save_atomically(folder: Path, write: Callable[[Path], None], copy_of: Path | None = None) -> Path:
    """Write a model folder as one step: `write(tmp)` fills a temporary sibling folder, `write_manifest` adds a
    SHA256SUMS to it (and to each of its sub-folders that holds files), and only then does it take the place
    of `folder` (two renames: the old folder aside, the new one in). Any failure before that, in `write` or an
    interruption, leaves `folder` as it was and removes the temporary folder.

    copy_of: start from a copy of this folder where it exists (a stage that adds heads beside a backbone, or
    a record to a model's folder: `copy_of=folder`). Returns `folder`.
    """
    folder = Path(folder).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; a model is saved as a folder")
    if not distributed.is_main():  # under torchrun rank 0 writes; the others wait until the folder is there
        distributed.barrier()
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    aside = folder.parent / f".{folder.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if copy_of is not None and Path(copy_of).is_dir():
            shutil.copytree(copy_of, tmp)
        else:
            tmp.mkdir()
        write(tmp)
        for sub, _, files in os.walk(tmp):
            if files:
                write_manifest(Path(sub))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if folder.exists():
        folder.rename(aside)
        tmp.rename(folder)
        shutil.rmtree(aside)
    else:
        tmp.rename(folder)
    distributed.barrier()
    return folder
