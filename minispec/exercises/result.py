"""The result of a check, how a checker runs the learner's function, and how it says what is wrong."""
from __future__ import annotations

import html
import traceback
from dataclasses import dataclass

import torch


class Wrong(Exception):
    """Raised inside a checker: the answer is wrong, and the message says how."""


class NotDone(Exception):
    """Raised inside a checker: the learner's function still raises NotImplementedError."""


STYLES = {  # status -> (symbol, background, border)
    "passed": ("✓", "#e8f5e9", "#2e7d32"),
    "failed": ("✗", "#ffebee", "#c62828"),
    "not done yet": ("…", "#f5f5f5", "#757575"),
}


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    message: str
    done: bool = True  # False while the exercise is still the blank it was shipped as

    @property
    def status(self) -> str:
        return "passed" if self.passed else "failed" if self.done else "not done yet"

    def __repr__(self) -> str:
        symbol = STYLES[self.status][0]
        return f"{symbol} {self.name}: {self.status}\n{self.message}"

    def _repr_html_(self) -> str:
        symbol, background, border = STYLES[self.status]
        return (f'<div style="background:{background};border-left:6px solid {border};padding:6px 10px;'
                f'color:#212121;font-family:sans-serif">'
                f'<b>{symbol} {html.escape(self.name)}: {self.status}</b>'
                f'<div style="white-space:pre-wrap;margin-top:4px">{html.escape(self.message)}</div></div>')


def call(fn, *args):
    """fn(*args); NotImplementedError -> NotDone, any other exception -> Wrong naming it and where it was raised."""
    try:
        return fn(*args)
    except NotImplementedError as e:
        raise NotDone from e
    except Exception as e:  # any error in the learner's code is a failed check, shown to them
        frames = traceback.extract_tb(e.__traceback__)
        where = f" (line {frames[-1].lineno}: {frames[-1].line})" if len(frames) > 1 and frames[-1].line else ""
        raise Wrong(f"your function raised {type(e).__name__}: {e}{where}") from None


def as_tensor(out, name: str, shape: tuple, dtype_kind: str = "float") -> torch.Tensor:
    """The learner's output as a tensor of `shape`, or Wrong saying what it is instead."""
    if not isinstance(out, torch.Tensor):
        raise Wrong(f"{name} must be a torch.Tensor of shape {list(shape)}, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise Wrong(f"{name} must have shape {list(shape)}, got {list(out.shape)}")
    if dtype_kind == "bool" and out.dtype != torch.bool:
        raise Wrong(f"{name} must be a bool tensor (True = may attend), got dtype {out.dtype}")
    if dtype_kind == "float" and not out.is_floating_point():
        raise Wrong(f"{name} must be a floating-point tensor, got dtype {out.dtype}")
    return out
