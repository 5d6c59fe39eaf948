"""MINISPEC_BACKEND=triton on a CPU runs the kernels in Triton's interpreter, whatever was imported first
(minispec/backend.py explains when Triton reads TRITON_INTERPRET).

Each case runs in a fresh process, without the TRITON_INTERPRET=1 that conftest.py sets for this one:
what is checked is the switch itself.
"""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path (no CUDA)")

PROBS_OF_ZEROS = "[[0.25, 0.25, 0.25, 0.25]]"


def run_python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINISPEC_BACKEND")}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**base, **env}, capture_output=True,
                          text=True, timeout=300)


def test_triton_backend_runs_on_cpu_when_triton_was_imported_first(tmp_path):
    # Loading a model with transformers imports triton (through torchao) before minispec can set
    # TRITON_INTERPRET, so Triton's own tl.max, tl.sum, ... are compiled for a GPU.
    code = ("import transformers, triton, torch\n"
            "import minispec\n"
            "from minispec.speculative.sampling import sampling_probs\n"
            "print(sampling_probs(torch.zeros(1, 4)).tolist())\n")
    out = run_python(code, tmp_path, MINISPEC_BACKEND="triton")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == PROBS_OF_ZEROS


def test_kernel_module_imported_for_a_gpu_is_imported_again_for_the_interpreter(tmp_path):
    # The kernel module is imported before MINISPEC_BACKEND=triton is set, so Triton compiles it for a GPU;
    # a dispatched call with CPU tensors must still run, in the interpreter.
    code = ("import os, torch\n"
            "import minispec.kernels.sampling as compiled\n"
            "from triton.runtime.jit import JITFunction\n"
            "assert isinstance(compiled._sampling_probs_kernel, JITFunction)\n"
            "os.environ['MINISPEC_BACKEND'] = 'triton'\n"
            "from minispec.speculative.sampling import sampling_probs\n"
            "print(sampling_probs(torch.zeros(1, 4)).tolist())\n")
    out = run_python(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == PROBS_OF_ZEROS


def test_triton_backend_runs_the_mamba_prefill_scan_in_the_interpreter(tmp_path):
    # HybridLM's prefill reaches the chunked SSD scan through Mamba2Mixer.forward; with MINISPEC_BACKEND=triton
    # on a CPU that is the kernel pipeline of kernels/ssd.py, interpreted, even after transformers imported triton.
    code = ("import os, sys, transformers, torch\n"
            "from minispec.ssm.config import Mamba2Config\n"
            "from minispec.ssm.mamba2 import Mamba2Mixer\n"
            "torch.manual_seed(0)\n"
            "mixer = Mamba2Mixer(Mamba2Config(hidden_size=16, num_heads=2, head_dim=8, state_size=4, chunk_size=4))\n"
            "u = torch.randn(1, 6, 16)\n"
            "with torch.no_grad():\n"
            "    out, _ = mixer(u)\n"
            "    os.environ['MINISPEC_BACKEND'] = 'torch'\n"
            "    ref, _ = mixer(u)\n"
            "kernel = sys.modules['minispec.kernels.ssd']._chunk_state_kernel\n"
            "print(type(kernel).__name__, bool((out - ref).abs().max() < 1e-5))\n")
    out = run_python(code, tmp_path, MINISPEC_BACKEND="triton")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "InterpretedFunction True"
