"""The one place that decides whether a component runs its PyTorch reference or its Triton kernel.

`MINISPEC_BACKEND` chooses:
    auto    (default) the kernel for CUDA tensors when triton is installed, the reference otherwise;
    torch   always the reference;
    triton  always the kernel; CPU tensors then run under Triton's interpreter.

When Triton reads TRITON_INTERPRET: in triton 3.9, each time `@triton.jit` decorates a function
(`triton.knobs.runtime.interpret`); a launch does not look at it again. Two kinds of function are
decorated at two different times:
- Triton's own library (`tl.max`, `tl.sum`, `tl.cumsum`, ... in triton.language.standard and
  .random) when triton is first imported. Loading a model with transformers imports it (through
  torchao), as do torch.compile and torchao themselves, often before minispec could set the variable.
  Compiled for a GPU, these fail inside an interpreted kernel ("Cannot call @triton.jit'd outside of
  the scope of a kernel"): `_kernel_module` then executes those modules again, for the interpreter.
- minispec's kernels when `minispec.kernels.<module>` is imported, which happens lazily, on first use,
  after `enable_interpreter_if_needed`. A kernel module already imported compiled for a GPU (e.g. by
  `import minispec.kernels.sampling` before MINISPEC_BACKEND=triton was set) and handed CPU tensors on
  a machine without CUDA is imported again, for the interpreter.
TRITON_INTERPRET=0 set by the user, or CPU tensors on a CUDA machine, give an error that says so.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import torch

BACKENDS = ("auto", "torch", "triton")


def backend_name() -> str:
    """The backend `MINISPEC_BACKEND` asks for (unset or empty means "auto")."""
    name = os.environ.get("MINISPEC_BACKEND") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"MINISPEC_BACKEND={name!r} is not one of {', '.join(BACKENDS)}")
    return name


def enable_interpreter_if_needed() -> None:
    """With MINISPEC_BACKEND=triton and no CUDA, kernels can only run in Triton's interpreter.

    Called when minispec is imported and again before each kernel module is imported. An explicit
    TRITON_INTERPRET is left as the user set it. Does not import triton.
    """
    if backend_name() == "triton" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def dispatch(kernel: str):
    """Decorate a reference so it runs the kernel `minispec.kernels.<module>.<function>` when asked.

    kernel: "module:function", e.g. "sampling:sampling_probs". The kernel takes the same arguments
    as the reference. The decorated function keeps both at hand: `.reference` and `.kernel`.
    """
    def decorate(reference):
        run_kernel = _lazy_kernel(kernel)

        @functools.wraps(reference)
        def dispatched(*args, **kwargs):
            use_kernel = _wants_kernel(_tensors(args, kwargs))
            return (run_kernel if use_kernel else reference)(*args, **kwargs)

        dispatched.reference = reference
        dispatched.kernel = run_kernel
        return dispatched

    return decorate


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _wants_kernel(tensors: list[torch.Tensor]) -> bool:
    name = backend_name()
    if name == "auto":
        return any(t.is_cuda for t in tensors) and importlib.util.find_spec("triton") is not None
    return name == "triton"


def _lazy_kernel(spec: str):
    """The kernel named by `spec`, imported on its first call, with the checks that stop it misrunning."""
    module_name, function_name = spec.split(":")

    def kernel(*args, **kwargs):
        on_cpu = not any(t.is_cuda for t in _tensors(args, kwargs))
        return getattr(_kernel_module(module_name, spec, on_cpu), function_name)(*args, **kwargs)

    return kernel


def _kernel_module(module_name: str, spec: str, on_cpu: bool):
    """`minispec.kernels.<module_name>`, imported so that it can run on the tensors it is given."""
    enable_interpreter_if_needed()
    try:
        importlib.import_module("triton")
    except ImportError as e:
        raise RuntimeError(
            f"the Triton kernel {spec} cannot run because triton does not import ({e}). Triton "
            "needs Linux; set MINISPEC_BACKEND=torch (or auto) to run the PyTorch reference."
        ) from e
    interpreting = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")  # as Triton reads it
    if interpreting:
        _triton_language_for_interpreter()
    module = importlib.import_module(f"minispec.kernels.{module_name}")
    if not (on_cpu and _compiled_for_gpu(module)):
        return module
    if interpreting:
        return _import_kernels_for_interpreter(module.__name__)
    raise RuntimeError(
        f"the Triton kernel {spec} got CPU tensors, but minispec.kernels.{module_name} was imported "
        f"without TRITON_INTERPRET=1 (it is {os.environ.get('TRITON_INTERPRET', 'unset')}), so Triton "
        "compiled it for a GPU. Pass CUDA tensors, or set TRITON_INTERPRET=1 before importing minispec "
        "to run the kernels in Triton's interpreter on the CPU (MINISPEC_BACKEND=triton does that on a "
        "machine without CUDA unless TRITON_INTERPRET is already set)."
    )


def _triton_language_for_interpreter() -> None:
    """Decorate Triton's own @triton.jit library for the interpreter, if triton was imported without it.

    Executing triton.language.standard and .random again makes their functions (and the tensor
    methods they add, `x.sum()`) interpreted ones; executing triton.language again rebinds `tl.max`
    and the other names it re-exports. Done only when TRITON_INTERPRET=1 asks for the interpreter.
    """
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if isinstance(tl.standard.max, JITFunction):
        for module in (tl.standard, tl.random, tl):
            importlib.reload(module)


def _import_kernels_for_interpreter(name: str):
    """Import every kernel module again, now that TRITON_INTERPRET=1, and return module `name`.

    All of them at once: a kernel module imports helpers from another (gemm from nvfp4), and those
    must be interpreted too. Whoever kept a reference to an old module keeps its GPU kernels.
    """
    for loaded in [m for m in sys.modules if m.startswith("minispec.kernels.")]:
        del sys.modules[loaded]
    return importlib.import_module(name)


@functools.cache
def _compiled_for_gpu(module) -> bool:
    # Under the interpreter `@triton.jit` makes an InterpretedFunction, which is not a JITFunction.
    from triton.runtime.jit import JITFunction

    return any(isinstance(v, JITFunction) for v in vars(module).values())
