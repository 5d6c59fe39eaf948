"""Resumable training state, shared by every training script in the package.

One file per run holds the state dicts of the run's modules (model, optimizer, ...), the step reached,
the history so far and the settings it was started with. A run resumes only with the same settings:
a changed learning rate or step count would silently make a different model.
"""
from __future__ import annotations

from pathlib import Path

import torch


def load(path: Path, modules: dict, settings: dict) -> tuple[int, list]:
    """Load `path` into `modules` ({name: module or optimizer}) if it exists: (start step, history)."""
    path = Path(path)
    if not path.exists():
        return 0, []
    state = torch.load(path, weights_only=False)
    if state["settings"] != settings:
        raise ValueError(f"{path} was written with other settings: {state['settings']}; "
                         "delete it or rerun with the same settings")
    for name, module in modules.items():
        module.load_state_dict(state[name])
    return state["step"], state["history"]


def save(path: Path, modules: dict, step: int, history: list, settings: dict, **extra) -> None:
    """Write the state atomically (a crash mid-write leaves the previous checkpoint intact)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: m.state_dict() for name, m in modules.items()}
    torch.save({**state, **extra, "step": step, "history": history, "settings": settings}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def stored(path: Path, key: str):
    """One extra entry written with `save(..., key=value)`, or None when there is no checkpoint yet."""
    path = Path(path)
    return torch.load(path, weights_only=False).get(key) if path.exists() else None
