"""Every Triton kernel compiles for sm_80, sm_90 and sm_100 (W4A4's FP4 tensor-core path: sm_100 only) on this
CPU-only machine, at every configuration its wrapper launches, within each arch's shared memory
(`tools/aot.py`, docs/kernels.md).

The compiles run in a fresh process: this one has TRITON_INTERPRET=1 (conftest.py), under which
`@triton.jit` makes interpreted functions that cannot be compiled. Triton's cache goes to a temporary
folder, so every run compiles from scratch and nothing is kept between runs.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="triton has no bundled ptxas here")


def fresh_python(args: list[str], tmp_path: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINISPEC_BACKEND")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """`python tools/aot.py` once for the module: its exit, its JSON and its Markdown page."""
    tmp = tmp_path_factory.mktemp("aot")
    out = fresh_python([str(ROOT / "tools" / "aot.py"), "--json", str(tmp / "kernels.json"), "--markdown",
                        str(tmp / "kernels.md")], tmp, timeout=1800)
    assert (tmp / "kernels.json").exists(), out.stderr[-3000:]
    return out, json.loads((tmp / "kernels.json").read_text()), (tmp / "kernels.md").read_text()


def test_every_kernel_compiles_for_every_arch_within_its_shared_memory(compiled):
    out, data, _ = compiled
    assert not data["problems"], "\n".join(data["problems"])
    assert out.returncode == 0, out.stderr[-3000:]
    archs = {}
    for row in data["rows"]:
        archs.setdefault((row["kernel"], json.dumps(row["launch"], sort_keys=True)), []).append(row["arch"])
    for (kernel, _), compiled_for in archs.items():
        expected = ["sm_100"] if kernel == "gemm._w4a4_block_scaled_kernel" else ["sm_80", "sm_90", "sm_100"]
        assert sorted(compiled_for) == sorted(expected), kernel
    assert all(row["num_warps"] >= 1 and row["registers"] > 0 for row in data["rows"])


def test_every_jit_function_is_launched_by_some_input(compiled):
    _, data, _ = compiled
    assert data["uncovered"] == []
    kernels = {row["kernel"] for row in data["rows"]}
    assert {"verify._verify_kernel", "kl._kl_forward_kernel", "kl._kl_backward_kernel", "gemm._w4a16_kernel",
            "sampling._sampling_probs_kernel", "sampling._one_hot_argmax_kernel", "nvfp4._quantize_kernel",
            "nvfp4._dequantize_kernel", "replay._replay_verify_kernel", "replay._replay_flush_kernel",
            "attention._dflash_attention_kernel", "gemm._w4a4_kernel", "gemm._w4a4_block_scaled_kernel",
            "ssd._chunk_state_kernel", "ssd._state_passing_kernel", "ssd._chunk_local_output_kernel",
            "ssd._chunk_output_kernel"} <= kernels


def test_wrappers_refuse_only_float64_inputs(compiled):
    """The grid tries float64 everywhere; the wrappers that refuse it say so. Any other refusal would mean an
    input of the grid is wrong, and the configurations it should have reached would go unchecked."""
    _, data, _ = compiled
    assert data["refused"] and all("float64" in message for message in data["refused"]), data["refused"]


def test_docs_kernels_md_is_current(compiled):
    _, data, page = compiled
    committed = (ROOT / "docs" / "kernels.md").read_text()
    if f"triton {data['triton']})" not in committed:
        pytest.skip(f"docs/kernels.md was written with another triton than {data['triton']}")
    assert committed == page, "docs/kernels.md is stale: python tools/aot.py --markdown docs/kernels.md"


FAKE_KERNELS = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _double(x):
    return x * 2


@triton.jit
def _copy_kernel(src, dst, n, DOUBLE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(src + i, mask=i < n)
    if DOUBLE:
        x = _double(x)
    tl.store(dst + i, x, mask=i < n)


@triton.jit
def _never_launched(x_ptr):
    tl.store(x_ptr, 0)


def copy(x):
    out = torch.empty_like(x)
    _copy_kernel[(1,)](x, out, x.numel(), DOUBLE=x.dtype == torch.float16, BLOCK=triton.next_power_of_2(x.numel()))
    return out
'''

RECORD_FAKE = '''
import json, sys
import torch
sys.path[:0] = [".", sys.argv[1]]
import fake_kernels
import aot

calls = [aot.Call(fake_kernels.copy, (torch.zeros(5, dtype=dtype),), {}) for dtype in (torch.float32, torch.float16)]
launches, refused = aot.record_launches(calls)
row = aot.compile_launch(launches[1], "sm_90")
print(json.dumps({"configs": [aot.describe(launch) for launch in launches],
                  "uncovered": aot.uncovered(launches, [fake_kernels]), "error": row["error"]}))
'''


def test_a_new_branch_is_recorded_and_an_unlaunched_kernel_is_named(tmp_path):
    """The configurations come from running the wrapper: a branch it takes on the input's dtype shows up as
    a second configuration without anyone listing it, and a kernel nothing launches is reported."""
    (tmp_path / "fake_kernels.py").write_text(textwrap.dedent(FAKE_KERNELS))
    out = fresh_python(["-c", RECORD_FAKE, str(ROOT / "tools")], tmp_path, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["configs"] == ["fp32,fp32 DOUBLE=False BLOCK=8", "fp16,fp16 DOUBLE=True BLOCK=8"]
    assert found["uncovered"] == ["fake_kernels._never_launched"]  # _double is reached through _copy_kernel
    assert found["error"] is None
