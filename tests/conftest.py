"""Shared test setup.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a kernel, i.e. when a kernel module is
imported; so it is set here, before any test module can import one. Without CUDA the interpreter is
the only way the kernels run, and running them is how the tests check them against the references.
The `gpu` and `slow` markers are declared in pyproject.toml. The `smollm2` fixture loads the real
target once per test session (converting its GGUF first on a machine that has not done it yet).
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


@pytest.fixture(scope="session")
def smollm2():
    """`(model, tokenizer)` of SmolLM2-135M-Instruct, loaded with the Hugging Face Hub offline.

    huggingface_hub reads HF_HUB_OFFLINE once, at import, so the constant is patched as well as the
    variable: any request the load tried to make would raise instead of reaching the network.
    """
    import huggingface_hub.constants

    import minispec as ms

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        return ms.load_target("smollm2-135m")
