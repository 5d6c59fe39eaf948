"""minispec: how NVIDIA's Nemotron 3.5 models are served fast, in readable PyTorch.

    import minispec as ms
    model, tok = ms.load_target("bolt-mini")
    out = ms.autoregressive_generate(model, input_ids, max_new_tokens=64)
    res = ms.speculative_generate(model, ms.load_drafter("ngram", model), input_ids, max_new_tokens=64)
    res.stats.tau
"""
from minispec.backend import enable_interpreter_if_needed

# On a CPU-only machine MINISPEC_BACKEND=triton means "run the kernels under the Triton interpreter".
# Switched on as early as possible: Triton reads TRITON_INTERPRET when it decorates a function (what is
# redone when triton was imported before minispec is in minispec/backend.py).
enable_interpreter_if_needed()

import logging


class _DropStartupNoise(logging.Filter):
    """Drops the log records that contain one of `fragments`."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(f in record.getMessage() for f in self.fragments)


# Where torchao is installed (the test extra brings it), the first transformers model class imported imports it,
# and it logs "Failed to load .../torchao/_C_mxfp8...so" for each CUDA extension a CPU build of torch cannot
# load, then registers two Enums with torch's pytree, which logs a deprecation warning for each: notes on
# torchao's own build that would land in a learner's first cell. Only those messages are dropped.
logging.getLogger("torchao").addFilter(_DropStartupNoise("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(
    _DropStartupNoise("is an Enum subclass and is now natively supported by torch.compile"))

from minispec.drafters import load_drafter
from minispec.speculative.autoregressive import Generation, autoregressive_generate
from minispec.speculative.speculative import SpecGeneration, speculative_generate
from minispec.targets.evalset import load_evalset
from minispec.targets.load import load_target
from minispec.targets.mtbench import load_mtbench

__all__ = ["Generation", "SpecGeneration", "autoregressive_generate", "load_drafter", "load_evalset", "load_mtbench",
           "load_target", "speculative_generate"]
