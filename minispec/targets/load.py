"""Load a target model the way a hub model loads: `from_pretrained` on a local folder.

The shipped targets live inside the package (`minispec/checkpoints/<name>/`), so nothing is
downloaded at run time; "smollm2-135m" (SmolLM2-135M-Instruct) comes from a pip-installed package and
is converted once into the user cache (`minispec.targets.smollm2`); any other local Hugging Face
causal-LM folder loads the same way.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minispec.manifest import check_manifest
from minispec.targets import smollm2

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
TARGETS = {
    "bolt-mini": "python -m minispec.targets.train bolt-mini --out minispec/checkpoints/bolt-mini",
    # bolt-mini's draft model; a causal LM too
    "bolt-nano": "python -m minispec.targets.train bolt-nano --out minispec/checkpoints/bolt-nano",
    # Nemotron-H hybrid (Mamba replay); the joint SFT stage trains it together with its MTP head
    "lightning-mini": "python -m minispec.targets.train lightning-mini, then python -m minispec.mtp.stages sft "
                      "--out minispec/checkpoints/lightning-mini",
}

# What a Hugging Face tokenizer is loaded from: a fast tokenizer, a SentencePiece model, or a BPE / WordPiece
# vocabulary, each usually beside a tokenizer_config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt")


def resolve(name_or_path: str | Path, known: dict[str, str] = TARGETS, kind: str = "target",
            also: list[str] = ()) -> Path:
    """A shipped model's name, or a local folder, to the folder to load from.

    known: shipped name -> the command that builds it; `also` are further valid names to list.
    """
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"the {kind} must be a name or a folder (str or Path), got {type(name_or_path).__name__}")
    if str(name_or_path) in known:
        folder = CHECKPOINTS / str(name_or_path)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{kind} {name_or_path!r} is not in {folder}; "
                                    f"build it with `{known[str(name_or_path)]}`")
        check_manifest(folder, rebuild=known[str(name_or_path)])
        return folder
    folder = Path(name_or_path)
    if folder.is_dir() and (folder / "config.json").exists():
        check_manifest(folder)
        return folder
    raise ValueError(f"unknown {kind} {str(name_or_path)!r}: expected one of {sorted([*known, *also])} "
                     "or a local folder with a config.json")


def load_target(name_or_path: str | Path, dtype: torch.dtype = torch.float32):
    """`(model, tokenizer)` for a shipped target name (e.g. "bolt-mini"), "smollm2-135m", or a local HF folder.

    Weights are stored in bfloat16 and computed in `dtype` (float32 by default: exact comparisons
    between decoding strategies are easiest to reason about in float32 on CPU). The folder must hold the
    tokenizer beside the weights, as a hub model's does.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (e.g. torch.float32), got {dtype!r}")
    if str(name_or_path) == smollm2.NAME:
        folder = smollm2.converted_folder()
    else:
        folder = resolve(name_or_path, also=[smollm2.NAME])
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): save the "
                                "tokenizer beside the weights, tokenizer.save_pretrained(folder)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer
