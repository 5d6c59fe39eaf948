"""Units, exactly as the sources use them, and the argument checks every cost function shares.

* ``MiB`` = 2**20 bytes and ``GiB`` = 2**30 bytes: memory payloads (KV cache, codes, states).
* ``GB`` = 10**9 bytes: checkpoint sizes on disk, as model cards and blogs quote them.
"""

from __future__ import annotations

import math

MiB = 2**20
GiB = 2**30
GB = 10**9

BF16_BYTES = 2  # bytes per BF16 (or FP16) element
BF16_BITS = 16


def to_mib(n_bytes: float) -> float:
    """Bytes -> MiB (2**20 bytes)."""
    return n_bytes / MiB


def to_gib(n_bytes: float) -> float:
    """Bytes -> GiB (2**30 bytes)."""
    return n_bytes / GiB


def to_gb(n_bytes: float) -> float:
    """Bytes -> GB (10**9 bytes), the unit of checkpoint sizes on model cards."""
    return n_bytes / GB


def check_positive(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")


def check_nonnegative(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value!r}")


def check_positive_int(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_fraction(**values: float) -> None:
    for name, value in values.items():
        check_nonnegative(**{name: value})
        if value > 1:
            raise ValueError(f"{name} is a fraction and must lie in [0, 1], got {value!r}")
