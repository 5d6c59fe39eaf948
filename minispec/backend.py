"""The one place that decides whether a component runs its PyTorch reference or its Triton kernel.

`MINISPEC_BACKEND` chooses:
    auto    (default) the kernel for CUDA tensors when triton is installed, the reference otherwise;
    torch   always the reference;
    triton  always the kernel; CPU tensors then run under Triton's interpreter.

When Triton reads TRITON_INTERPRET: in triton 3.9 it is read afresh each time `@triton.jit` decorates
a function (`triton.knobs.runtime.interpret`), which happens when a kernel module is imported. It is
not read at `import triton`, and a launch does not look at it again: a kernel decorated without it
stays compiled for a GPU for the life of the process. So the interpreter must be switched on before
`minispec.kernels.<module>` is first imported. Kernel modules are imported lazily, on first use,
which gives `enable_interpreter_if_needed` the chance to do that.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os

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

    @functools.cache
    def load():
        enable_interpreter_if_needed()
        try:
            importlib.import_module("triton")
        except ImportError as e:
            raise RuntimeError(
                f"the Triton kernel {spec} cannot run because triton does not import ({e}). Triton "
                "needs Linux; set MINISPEC_BACKEND=torch (or auto) to run the PyTorch reference."
            ) from e
        module = importlib.import_module(f"minispec.kernels.{module_name}")
        return getattr(module, function_name), _compiled_for_gpu(module)

    def kernel(*args, **kwargs):
        fn, compiled_for_gpu = load()
        if compiled_for_gpu and not any(t.is_cuda for t in _tensors(args, kwargs)):
            raise RuntimeError(
                f"the Triton kernel {spec} got CPU tensors, but minispec.kernels.{module_name} was "
                "imported without TRITON_INTERPRET=1, so Triton compiled it for a GPU. Triton reads "
                "TRITON_INTERPRET when a kernel module is imported: set TRITON_INTERPRET=1 before "
                "importing minispec (MINISPEC_BACKEND=triton does that on a machine without CUDA, "
                "unless TRITON_INTERPRET is already set), or pass CUDA tensors."
            )
        return fn(*args, **kwargs)

    return kernel


def _compiled_for_gpu(module) -> bool:
    # Under the interpreter `@triton.jit` makes an InterpretedFunction, which is not a JITFunction.
    from triton.runtime.jit import JITFunction

    return any(isinstance(v, JITFunction) for v in vars(module).values())
