"""Argument types shared by every command line (`python -m minispec ...`, `minispec.bench`, the trainers).

Each refuses a bad value while the arguments are parsed, before any work starts; argparse prefixes the
message with the flag's name (`argument --steps: must be an integer >= 1, got 0`).
"""
from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1: a count of steps, prompts, rows or repeats."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0: a count where zero means "none" (e.g. no sampled replies)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0: a learning rate, a scale."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0: a temperature (0 = greedy), a loss weight."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: 0 (greedy) or one the samplers accept (`check_sampling_args`)."""
    from minispec.speculative.sampling import check_sampling_args

    value = non_negative_float(text)
    try:
        check_sampling_args(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value
