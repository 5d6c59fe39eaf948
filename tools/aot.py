"""Every Triton kernel compiled ahead of time for real GPUs, on a machine that has none.

The tests run the kernels under TRITON_INTERPRET=1, which accepts code the GPU compiler rejects
(block shapes, tl.dot's minimum tile of 16, dtype rules, shared memory beyond the chip) and says
nothing about registers. So each kernel is also compiled, with `triton.compile` and a `GPUTarget`,
for sm_80 (A100), sm_90 (H100 / H200) and sm_100 (B200), at every configuration its Python wrapper
launches (a kernel for one arch only, such as W4A4's FP4 tensor-core path, for that arch: `ONLY_FOR`).
No table of configurations is kept by hand; they are recorded from the wrappers themselves:

1. `record_launches` runs the public wrappers (the functions minispec.backend dispatches to) on CPU
   tensors over `CALLS`, a small grid of inputs: every floating dtype (a wrapper refuses the ones it
   does not take), and shapes that make each size-dependent choice at its smallest and at its cap or at
   the published model sizes. While it runs, `JITFunction.run` is replaced by a recorder: each launch
   yields its kernel, argument types, constexpr values and options (num_warps, ...), and nothing runs.
   The kernel modules must therefore be imported compiled for a GPU, not for the interpreter.
2. `compile_launch` compiles one recorded launch for one arch and reads what the compiled kernel
   needs: shared memory and warps from Triton's metadata, registers and local (spill) memory per
   thread from the cubin (`cuobjdump -res-usage`, shipped with Triton).
3. `uncovered` names every @triton.jit function in minispec.kernels that no recorded launch reaches,
   so a new kernel without an input in `CALLS` fails tests/test_kernel_compile.py.

`python tools/aot.py --markdown docs/kernels.md` writes the table of docs/kernels.md.

What this cannot check: timing, and correctness on a device (the interpreter tests check the
arithmetic, `pytest -m gpu` on a GPU checks the compiled code).
"""
from __future__ import annotations

import argparse
import ast
import functools
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

# Shared memory one thread block may use (the opt-in maximum), from the CUDA C++ Programming Guide's
# "Technical Specifications per Compute Capability": 163 KB on compute capability 8.0, 227 KB on 9.0
# and 10.0 (also in NVIDIA's Ampere, Hopper and Blackwell tuning guides).
ARCHS = {"sm_80": (80, 163 * 1024), "sm_90": (90, 227 * 1024), "sm_100": (100, 227 * 1024)}
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@dataclass(frozen=True)
class Launch:
    """One distinct way a wrapper launches a kernel: all an ahead-of-time compile needs.

    signature: (parameter, type) in order, e.g. ("p_ptr", "*fp32"), ("V", "i32"), ("BLOCK_V", "constexpr")
    constexprs: (parameter, value) of the kernel's tl.constexpr parameters
    aligned: pointer parameters whose address is a multiple of 16 (Triton specialises on it)
    options: the compile options the wrapper passed, e.g. ("num_warps", 8)
    """

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    aligned: tuple[str, ...]
    options: tuple[tuple[str, object], ...]

    @property
    def name(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.kernel}"


# --- 1. recording launches -----------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """One call of a public wrapper: fn(*args, **kwargs)."""

    fn: object
    args: tuple
    kwargs: dict


@contextmanager
def recording():
    """Inside the block, launching a compiled-for-GPU kernel records a `Launch` instead of running."""
    launches = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(_launch(self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def _launch(kernel: JITFunction, args: tuple, kwargs: dict) -> Launch:
    names = [p.name for p in kernel.params]
    options = {k: v for k, v in kwargs.items() if k not in names}
    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    signature, constexprs, aligned = [], [], []
    for param in kernel.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature.append((param.name, "constexpr"))
            constexprs.append((param.name, value))
            continue
        # Integers and floats are compiled for any value: no specialisation on 1 or on multiples of 16.
        pointer = isinstance(value, torch.Tensor)
        kind, attr = native_specialize_impl(BaseBackend, value, param.is_const, pointer, True)
        signature.append((param.name, kind))
        if attr == "D":
            aligned.append(param.name)
    return Launch(kernel.fn.__module__, kernel.fn.__name__, tuple(signature), tuple(constexprs), tuple(aligned),
                  tuple(sorted(options.items())))


def record_launches(calls) -> tuple[list[Launch], list[str]]:
    """Run each `Call` with launches recorded: (the distinct launches in first-seen order, refusals).

    A wrapper that refuses its input (ValueError or TypeError: a dtype it does not take) adds
    "module.function: message" to the refusals; any other error propagates.
    """
    refused = []
    with recording() as launches:
        for call in calls:
            try:
                call.fn(*call.args, **call.kwargs)
            except (ValueError, TypeError) as e:
                refused.append(f"{call.fn.__module__}.{call.fn.__name__}: {e}")
    return list(dict.fromkeys(launches)), refused


# --- the inputs: every wrapper over its branches --------------------------------------------------

def _verify_calls():
    from minispec.kernels.verify import verify

    for V in (5, 262_144):  # BLOCK_V at its smallest (8) and at its cap (2048)
        for dtype in FLOATS:
            p = torch.zeros(2, 4, V, dtype=dtype)
            p[..., 0] = 1  # exact in every dtype, so the distribution check passes
            drafts = torch.zeros(2, 3, dtype=torch.long)
            yield Call(verify, (drafts, p), {})
            yield Call(verify, (drafts, p, p[:, :3]), {})


def _kl_forward_backward(teacher, student):
    from minispec.kernels.kl import kl_divergence

    kl_divergence(teacher, student).backward()


def _kl_calls():
    for V in (100, 262_144):  # BLOCK_V 128 with 4 warps; its cap 4096 with 8 warps
        for dtype in FLOATS:
            student = torch.zeros(2, V, dtype=dtype, requires_grad=True)
            yield Call(_kl_forward_backward, (torch.zeros(2, V, dtype=dtype), student), {})


def _sampling_calls():
    from minispec.kernels.sampling import sampling_probs

    for V in (10, 262_144):  # BLOCK at its smallest (16) and at its cap (1024)
        for dtype in FLOATS:
            logits = torch.zeros(2, V, dtype=dtype)
            yield Call(sampling_probs, (logits, 0.0), {})
            for top_k in (None, 5):
                for top_p in (None, 0.9):
                    yield Call(sampling_probs, (logits, 1.0), {"top_k": top_k, "top_p": top_p})


def _nvfp4_calls():
    from minispec.kernels.nvfp4 import dequantize, quantize
    from minispec.quant.nvfp4 import quantize as reference_quantize

    for dtype in FLOATS:
        for four_over_six in (False, True):
            yield Call(quantize, (torch.ones(4, 64, dtype=dtype),), {"four_over_six": four_over_six})
    w = reference_quantize.reference(torch.ones(4, 64))
    yield Call(dequantize, (w.codes, w.block_scales, w.global_scale), {})


def _gemm_calls():
    from minispec.kernels.gemm import w4a16_matmul
    from minispec.quant.nvfp4 import quantize

    for K in (16, 2560):  # BLOCK_K at its smallest (16) and at its cap (128)
        w = quantize.reference(torch.ones(64, K))
        for M in (1, 64):  # BLOCK_M 16 (decoding) and its cap 64
            for dtype in FLOATS:
                yield Call(w4a16_matmul, (torch.ones(M, K, dtype=dtype), w), {})


def _w4a4_calls():
    from minispec.kernels.gemm import launch_w4a4, w4a4_matmul
    from minispec.quant.nvfp4 import quantize

    g_x = torch.tensor(1.0)
    # Both blocks at their smallest (BLOCK_M 16 for decoding, BLOCK_K 16) and both at their caps (64, 128):
    # the kernel's other sizes are the W4A16 kernel's, whose grid crosses them.
    for M, K in ((1, 16), (64, 2560)):
        w = quantize.reference(torch.ones(64, K))
        for dtype in FLOATS:
            yield Call(w4a4_matmul, (torch.ones(M, K, dtype=dtype), w, g_x), {})
    # The sm_100 path (FP4 tensor cores), which the wrapper takes for bf16 activations on such a device only.
    yield Call(launch_w4a4, (torch.ones(64, 2560, dtype=torch.bfloat16), w, g_x, True), {})


def _mamba_inputs(cases):
    """For each (Mamba2Config, *sizes) of `cases` and each floating dtype: its H, P, N, G, a zeros() of that
    dtype and the sizes."""
    for shape, *sizes in cases:
        for dtype in FLOATS:
            yield (shape.num_heads, shape.head_dim, shape.state_size, shape.n_groups,
                   functools.partial(torch.zeros, dtype=dtype), *sizes)


def _tiny_mamba():
    from minispec.ssm.config import Mamba2Config

    return Mamba2Config(hidden_size=2, num_heads=2, head_dim=2, state_size=2, n_groups=1)


def _replay_calls():
    from minispec import costs
    from minispec.kernels.replay import replay_flush, replay_verify

    # A test-sized ring, and Super's Mamba-2 heads with a ring of 16 records since the checkpoint and a
    # verify window of 8.
    for H, P, N, G, zeros, L, T in _mamba_inputs(((_tiny_mamba(), 2, 1), (costs.SUPER_MAMBA2, 16, 8))):
        state, x, B, C = zeros(1, H, P, N), zeros(1, L, H, P), zeros(1, L, G, N), zeros(1, T, G, N)
        dt, A, D = zeros(1, L, H) + 1, zeros(H) - 1, zeros(H) + 1
        yield Call(replay_verify, (state, x, dt, B, C, A, D, L - T), {})
        yield Call(replay_flush, (state, x, dt, B, A), {})


def _ssd_calls():
    from minispec import costs
    from minispec.kernels.ssd import ssd_chunked

    # A test-sized scan, and lightning-mini's Mamba-2 layers (chunk 64) over two chunks. Super's sizes
    # (chunk 128, P = 64, N = 128) compile too, but take minutes per arch on a CPU: see kernels/ssd.py.
    for H, P, N, G, zeros, T, Q in _mamba_inputs(((_tiny_mamba(), 3, 2), (costs.LIGHTNING_MINI_MAMBA2, 70, 64))):
        x, B, dt = zeros(1, T, H, P), zeros(1, T, G, N), zeros(1, T, H) + 1
        yield Call(ssd_chunked, (x, dt, zeros(H) - 1, B, B, zeros(H), zeros(1, H, P, N)), {"chunk_size": Q})


def _attention_calls():
    from minispec import costs
    from minispec.kernels.attention import dflash_attention

    e4b = costs.E4B_DFLASH
    # (T, Hq, Hkv, D, window): a test-sized block, and the Bolt E4B drafter's (block 8, 32 q / 8 kv
    # heads of 128, window 1024).
    for T, Hq, Hkv, D, W in ((2, 2, 1, 8, 4), (e4b.block_size, e4b.num_attention_heads, e4b.num_key_value_heads,
                                                e4b.head_dim, e4b.sliding_window)):
        for dtype in FLOATS:
            q, k_blk = torch.zeros(1, T, Hq, D, dtype=dtype), torch.zeros(1, T, Hkv, D, dtype=dtype)
            k_ctx, lens = torch.zeros(1, 40, Hkv, D, dtype=dtype), torch.tensor([40])
            for window in (None, W):
                yield Call(dflash_attention, (q, k_ctx, k_ctx, k_blk, k_blk, lens), {"window": window})


CALLS = {"verify": _verify_calls, "kl": _kl_calls, "sampling": _sampling_calls, "nvfp4": _nvfp4_calls,
         "gemm": _gemm_calls, "w4a4": _w4a4_calls, "replay": _replay_calls, "ssd": _ssd_calls,
         "attention": _attention_calls}

# Kernels for one arch only (every other kernel compiles for all of ARCHS): the FP4 tensor-core path of
# W4A4 needs Blackwell's E4M3 and block-scaled MMA, which sm_80 does not have (its compile fails there).
ONLY_FOR = {"gemm._w4a4_block_scaled_kernel": ("sm_100",)}


def all_calls():
    for calls in CALLS.values():
        yield from calls()


# --- 3. coverage ---------------------------------------------------------------------------------

def kernel_modules() -> list:
    """Every module of minispec.kernels, imported."""
    import minispec.kernels

    names = [m.name for m in pkgutil.iter_modules(minispec.kernels.__path__)]
    return [importlib.import_module(f"minispec.kernels.{name}") for name in names]


def jit_functions(modules) -> dict[str, JITFunction]:
    """"module.function" -> each @triton.jit function defined (not merely imported) in `modules`."""
    found = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                found[f"{module.__name__.rsplit('.', 1)[-1]}.{value.fn.__name__}"] = value
    return found


def _callees(fn: JITFunction) -> list[JITFunction]:
    names = {node.id for node in ast.walk(ast.parse(fn.src)) if isinstance(node, ast.Name)}
    return [v for n in names if isinstance(v := fn.fn.__globals__.get(n), JITFunction) and v is not fn]


def uncovered(launches: list[Launch], modules) -> list[str]:
    """The @triton.jit functions of `modules` that no launch runs, directly or through the helpers it calls."""
    functions = jit_functions(modules)
    todo = [getattr(importlib.import_module(launch.module), launch.kernel) for launch in launches]
    reached = set()
    while todo:
        fn = todo.pop()
        if id(fn) not in reached:
            reached.add(id(fn))
            todo += _callees(fn)
    return sorted(name for name, fn in functions.items() if id(fn) not in reached)


# --- 2. compiling --------------------------------------------------------------------------------

def compile_launch(launch: Launch, arch: str) -> dict:
    """Compile `launch` for `arch` ("sm_90"): a row with what the compiled kernel needs, or the error."""
    capability, shared_limit = ARCHS[arch]
    row = {"kernel": launch.name, "arch": arch, "launch": asdict(launch), "shared_limit": shared_limit}
    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{launch.name} was imported for Triton's interpreter (TRITON_INTERPRET=1); "
                           "compile in a process where TRITON_INTERPRET is unset or 0")
    index = {name: i for i, (name, _) in enumerate(launch.signature)}
    source = ASTSource(kernel, dict(launch.signature), {(index[k],): v for k, v in launch.constexprs},
                       {(index[name],): [["tt.divisibility", 16]] for name in launch.aligned})
    start = time.perf_counter()
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(launch.options))
    except Exception as e:  # the compiler's message is the result
        return {**row, "seconds": round(time.perf_counter() - start, 1), "error": f"{type(e).__name__}: {e}"[-3000:]}
    return {**row, "seconds": round(time.perf_counter() - start, 1), "num_warps": compiled.metadata.num_warps,
            "num_stages": compiled.metadata.num_stages, "shared": compiled.metadata.shared,
            **_registers(compiled.asm["cubin"]), "error": None}


def _registers(cubin: bytes) -> dict:
    """Registers and local memory (spills) per thread, as ptxas allotted them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = dict(item.split(":", 1) for line in out.splitlines() if "REG:" in line for item in line.split())
    return {"registers": int(usage["REG"]), "local_bytes": int(usage["LOCAL"])}


def _compile_job(job: tuple[Launch, str]) -> dict:
    return compile_launch(*job)


def compile_all(launches: list[Launch], archs=tuple(ARCHS), workers: int | None = None, progress=None) -> list[dict]:
    """Every launch for every arch it is for (`ONLY_FOR`), on `workers` processes (default: one per CPU core)."""
    jobs = [(launch, arch) for launch in launches for arch in archs if arch in ONLY_FOR.get(launch.name, archs)]
    workers = workers or os.cpu_count() or 1
    # Fresh processes: they import the kernels compiled for a GPU, whatever this process's threads hold.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        rows = []
        for row in pool.map(_compile_job, jobs):
            rows.append(row)
            if progress:
                progress(f"[{len(rows)}/{len(jobs)}] {row['kernel']} {row['arch']}: "
                         + (f"{row['shared']} B shared" if row["error"] is None else "FAILED"))
        return rows


def problems(rows: list[dict]) -> list[str]:
    """A line for each compile that failed or asks for more shared memory than its arch has."""
    out = []
    for row in rows:
        config = describe(Launch(**{k: _tuples(v) for k, v in row["launch"].items()}))
        if row["error"]:
            out.append(f"{row['kernel']} {row['arch']} [{config}]: {row['error']}")
        elif row["shared"] > row["shared_limit"]:
            out.append(f"{row['kernel']} {row['arch']} [{config}]: {row['shared']} bytes of shared memory, "
                       f"over the {row['shared_limit']} a block may use")
    return out


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# --- the table -----------------------------------------------------------------------------------

def describe(launch: Launch) -> str:
    """The configuration in a few words: pointer element types, constexprs, options."""
    pointers = [t[1:] for _, t in launch.signature if t.startswith("*")]
    constexprs = [f"{k}={v}" for k, v in launch.constexprs]
    options = [f"{k}={v}" for k, v in launch.options]
    return " ".join([",".join(pointers), *constexprs, *options])


PAGE = """# Kernels compiled for GPUs

Every Triton kernel in `kernels/` is compiled ahead of time, on a CPU-only machine, for sm_80 (A100),
sm_90 (H100, H200) and sm_100 (B200), at every configuration its Python wrapper launches; W4A4's FP4
tensor-core path (`gemm._w4a4_block_scaled_kernel`, `tl.dot_scaled` on E2M1 with E4M3 scales per 16), which
the wrapper takes on sm_100 only, is compiled for sm_100 only ("-" in the other columns).
`tests/test_kernel_compile.py` runs `python tools/aot.py`, which runs the public wrappers
over a grid of inputs (every floating dtype; each size-dependent block at its smallest and at its cap
or at the published model sizes), records each kernel launch instead of running it, and compiles every
distinct launch with `triton.compile` and a `GPUTarget`. The test fails on a compile error, on a block
that asks for more shared memory than the arch gives one block (163 KB on sm_80, 227 KB on sm_90 and
sm_100), and on a `@triton.jit` function that no input launches.

What this checks: that the GPU compiler accepts the code (block shapes, `tl.dot`'s minimum tile of 16,
dtype rules, loop-carried types: the interpreter the other tests run in lets all of these through), the
shared memory each block needs, and the registers and local memory (spilled registers) that ptxas gives
each thread. What it cannot check: speed, and correctness on a device. Those need a GPU:
`pytest -m gpu` and `python -m minispec.bench gpu`.

Configuration: the element types of the pointer arguments in order, then the constexprs and the options
the wrapper passed. `regs`: registers per thread; `spill B`: local memory per thread, the largest over
the three archs (0: nothing spilled).

This page is written by `python tools/aot.py --markdown docs/kernels.md` ({launches}
configurations x {archs} archs, triton {triton}); `tests/test_kernel_compile.py` checks it is current when
it runs the same triton. Inputs of the grid that a wrapper refuses, and so never launches:
{refused}

"""


def markdown(rows: list[dict], refused: list[str]) -> str:
    """docs/kernels.md: the page above, then one line per kernel and configuration with shared memory,
    registers and spills per arch."""
    archs = list(dict.fromkeys(row["arch"] for row in rows))
    by_config = {}
    for row in rows:
        key = (row["kernel"], json.dumps(row["launch"], sort_keys=True))
        by_config.setdefault(key, {})[row["arch"]] = row
    refusals = "\n".join(f"- {r}" for r in sorted(set(refused))) or "- none"
    page = PAGE.format(launches=len(by_config), archs=len(archs), triton=triton.__version__, refused=refusals)
    head = ["kernel", "configuration", "warps", *(f"shared B {a}" for a in archs), *(f"regs {a}" for a in archs),
            "spill B"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (kernel, launch_json), per_arch in by_config.items():
        launch = Launch(**{k: _tuples(v) for k, v in json.loads(launch_json).items()})
        ok = [r for r in per_arch.values() if not r["error"]]
        warps = ok[0]["num_warps"] if ok else "-"
        shared = [_cell(per_arch.get(a), "shared") for a in archs]
        regs = [_cell(per_arch.get(a), "registers") for a in archs]
        spills = max((r["local_bytes"] for r in ok), default="-")
        lines.append("| " + " | ".join([kernel, f"`{describe(launch)}`", str(warps), *shared, *regs, str(spills)])
                     + " |")
    return page + "\n".join(lines) + "\n"


def _cell(row, key) -> str:
    if row is None:
        return "-"
    return "failed" if row["error"] else f"{row[key]:,}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/aot.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every compile's row here")
    p.add_argument("--markdown", type=Path, help="write the table of docs/kernels.md here")
    p.add_argument("--workers", type=int, help="compile processes (default: one per CPU core)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"):
        p.error("TRITON_INTERPRET is set (by you, or by MINISPEC_BACKEND=triton on a machine without CUDA), so "
                "the kernels would be imported for the interpreter: run without both")
    start = time.perf_counter()
    launches, refused = record_launches(all_calls())
    missing = uncovered(launches, kernel_modules())
    print(f"recorded {len(launches)} launch configurations in {time.perf_counter() - start:.1f} s", flush=True)
    rows = compile_all(launches, workers=args.workers, progress=lambda line: print(line, flush=True))
    found = problems(rows)
    elapsed = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "seconds": round(elapsed, 1), "rows": rows,
                                         "refused": refused, "uncovered": missing, "problems": found}, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(rows, refused))
    print(f"{len(rows)} compiles ({len(launches)} configurations, each for the archs it is for) in {elapsed:.0f} s")
    for line in [*(f"not launched by any input in CALLS: {m}" for m in missing), *found]:
        print(line, file=sys.stderr)
    return 1 if missing or found else 0


if __name__ == "__main__":
    sys.exit(main())
