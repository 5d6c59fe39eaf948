"""The training corpus: the Python standard library of the running interpreter.

Every machine has it, it is code (what Nemotron's agentic benchmarks are about), and it is
predictable enough that drafting pays. Files are split into train / val / test by a stable hash
of their path relative to the stdlib root, so the split does not depend on the machine or on the
order files are listed in. Different Python versions have different files; that is why the
evaluation set that every benchmark uses is shipped frozen as token ids
(`minispec.targets.evalset`), not rebuilt from this corpus.

Sizes on CPython 3.11.7 (measured by `describe()`): see docs/models.md.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "val", "test")
# Percent of files in each split, decided by the first byte of the path's SHA-256.
SPLIT_PERCENT = {"train": 90, "val": 5, "test": 5}
# Generated tables (unicode data, pydoc topics) are not code a person writes.
MAX_FILE_BYTES = 256 * 1024


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """Stable split of one file: `sha256(relpath) mod 100` against the split percentages."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "big") % 100
    if bucket < SPLIT_PERCENT["train"]:
        return "train"
    if bucket < SPLIT_PERCENT["train"] + SPLIT_PERCENT["val"]:
        return "val"
    return "test"


def iter_files(split: str, root: Path | None = None) -> list[SourceFile]:
    """All `.py` files of one split, sorted by relative path."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        if path.stat().st_size > MAX_FILE_BYTES or split_of(rel) != split:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(SourceFile(rel, text))
    return files


def data_hash(files: list[SourceFile]) -> str:
    """SHA-256 over (path, text) of every file: recorded beside each trained checkpoint."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode())
        h.update(b"\0")
        h.update(f.text.encode())
        h.update(b"\0")
    return h.hexdigest()


def describe(root: Path | None = None) -> dict[str, dict[str, int]]:
    """Files and characters per split."""
    out = {}
    for split in SPLITS:
        files = iter_files(split, root)
        out[split] = {"files": len(files), "chars": sum(len(f.text) for f in files)}
    return out
