"""Shared test setup.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a kernel, i.e. when a kernel module is
imported; so it is set here, before any test module can import one. Without CUDA the interpreter is
the only way the kernels run, and running them is how the tests check them against the references.
The `gpu` and `slow` markers are declared in pyproject.toml.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="gpu: needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
