"""Export to (and import from) the HF-native DFlash format that z-lab's code, vLLM and SGLang read.

A folder with `config.json` and `model.safetensors`, as z-lab publishes its drafters (z-lab/dflash) and
vLLM loads them (`vllm/model_executor/models/qwen3_dflash.py`):

* config: `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"` (so `AutoConfig` gives a
  `Qwen3Config` carrying the extra keys), the Qwen3 backbone keys, top-level `block_size`,
  `num_target_layers`, `target_hidden_size`, and `dflash_config` with `mask_token_id`,
  `target_layer_ids` (DFlash semantics: the OUTPUT of layer i; vLLM adds 1 itself), `block_size`,
  `use_swa` / `swa_window_size` and `causal: false` (vLLM would otherwise run sliding layers causally).
* weights: the drafter's own tensors only, named without a `model.` prefix; `lm_head.weight` only
  when the drafter owns its head (vLLM then uses it, else it shares the target's); `d2t` when it
  drafts over a reduced vocabulary (EAGLE-3's layout: draft id i is target id i + d2t[i]), with
  `draft_vocab_size` in the config.

Reading goes through `minispec.dflash.config.read_hf_config`, the one resolver of that format.
minispec's own `save_pretrained` folder (model_type "minispec_dflash") keeps the same weight names;
`load_drafter_model` reads either format.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minispec.dflash.config import ARCHITECTURE, SLIDING, DFlashConfig, config_from_hf_dflash
from minispec.dflash.model import DFlashDraftModel
from minispec.manifest import check_manifest

# Every config key vLLM's DFlash loader reads (vllm/model_executor/models/qwen3_dflash.py, and
# eagle3_utils.get_eagle3_aux_layers_from_config for the taps), plus the two top-level keys z-lab's
# loader and SGLang read (block_size, num_target_layers). Optional keys vLLM falls back on when
# absent (is_causal, is_neox_style, eagle_aux_hidden_state_layer_ids, draft_vocab_size, logit_scale,
# attention_sink_bias, use_aux_hidden_state) are left out on purpose, except is_neox_style, which
# we state because a mismatch fails silently.
VLLM_CONFIG_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size",
    "attention_bias", "rope_parameters", "layer_types", "sliding_window", "target_hidden_size", "block_size",
    "num_target_layers", "tie_word_embeddings", "is_neox_style",
)
VLLM_DFLASH_CONFIG_KEYS = ("mask_token_id", "target_layer_ids", "causal", "use_swa", "swa_window_size")


def hf_dflash_config(config: DFlashConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` of the HF-native DFlash format for `config`."""
    sliding = [t == SLIDING for t in config.layer_types]
    window = config.sliding_window if any(sliding) else None
    dflash = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "use_swa": all(sliding),
        "causal": False,
    }
    if window is not None:
        dflash["swa_window_size"] = window
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "target_hidden_size": config.target_hidden_size,
        "dflash_config": dflash,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "is_neox_style": True,  # minispec's RoPE rotates halves
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": config.attention_bias,
        "tie_word_embeddings": False,
        "layer_types": list(config.layer_types),
        "sliding_window": window,
        "use_sliding_window": window is not None,
        "max_window_layers": 0,  # Qwen3Config: layers from this index on may slide; layer_types decides
        "has_own_lm_head": config.has_own_lm_head,
        "draft_vocab_size": config.draft_vocab_size,
        "final_logit_softcapping": config.final_logit_softcapping,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),  # the name transformers 4.x (and older vLLM) read
    }


def export_hf_dflash(model: DFlashDraftModel, folder, dtype: torch.dtype | None = None) -> Path:
    """Write `model` to `folder` in the HF-native DFlash format; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = model.dtype if dtype is None else dtype
    tensors = {name: (t if name == "d2t" else t.detach().to(dtype)).contiguous().cpu()  # d2t stays integer
               for name, t in model.state_dict().items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_dflash_config(model.config, dtype), indent=2) + "\n")
    return folder


def load_hf_dflash(folder, target=None) -> DFlashDraftModel:
    """Read an HF-native DFlash folder; attached to `target` when one is given."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if "embed_tokens.weight" in tensors:
        raise ValueError("this drafter stores its own embed_tokens.weight; minispec's DFlash drafter always uses the "
                         "target's embedding")
    tensors.pop("t2d", None)  # EAGLE-3's boolean mask over the target vocabulary: d2t already says it all
    d2t = tensors.get("d2t")
    config = config_from_hf_dflash(cfg, has_lm_head="lm_head.weight" in tensors,
                                   target_config=None if target is None else target.config,
                                   draft_vocab_size=None if d2t is None else len(d2t))
    dtype = next(t for name, t in tensors.items() if name != "d2t").dtype
    model = DFlashDraftModel(config).to(dtype)
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape != model.fc.weight.shape:
        raise ValueError(f"fc.weight is {tuple(fc.shape)} but the config's {config.num_taps} taps of width "
                         f"{config.target_hidden_size} into hidden {config.hidden_size} need "
                         f"{tuple(model.fc.weight.shape)}")
    missing = sorted(set(model.state_dict()) - set(tensors))
    unexpected = sorted(set(tensors) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
    model.load_state_dict({name: t.long() if name == "d2t" else t for name, t in tensors.items()})
    if target is not None:
        model.attach_target(target)
    return model.eval()


def load_drafter_model(folder, target=None) -> DFlashDraftModel:
    """A drafter from either format: minispec's `save_pretrained` folder or an HF-native export, checked
    against the folder's SHA256SUMS when it has one (`minispec.manifest`)."""
    folder = Path(folder)
    check_manifest(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") == DFlashConfig.model_type:
        model = DFlashDraftModel.from_pretrained(folder).eval()
        if target is not None:
            model.attach_target(target)
        return model
    return load_hf_dflash(folder, target)
