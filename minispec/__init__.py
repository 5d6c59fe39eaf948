"""minispec: how NVIDIA's Nemotron 3.5 models are served fast, in readable PyTorch.

    import minispec as ms
    model, tok = ms.load_target("bolt-mini")
    out = ms.autoregressive_generate(model, input_ids, max_new_tokens=64)
"""
from minispec.backend import enable_interpreter_if_needed

# Must run before anything imports triton: on a CPU-only machine, MINISPEC_BACKEND=triton means
# "run the kernels under the Triton interpreter".
enable_interpreter_if_needed()

from minispec.spec.autoregressive import Generation, autoregressive_generate  # noqa: E402
from minispec.targets.evalset import load_evalset  # noqa: E402
from minispec.targets.load import load_target  # noqa: E402

__all__ = ["Generation", "autoregressive_generate", "load_evalset", "load_target"]
