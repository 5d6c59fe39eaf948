"""Save and load a quantized model in the Hugging Face layout NVIDIA Model Optimizer exports for NVFP4.

    folder/config.json           the model's config plus "quantization_config" (quant_method "modelopt")
    folder/hf_quant_config.json  {"producer": ..., "quantization": the same fields}
    folder/model.safetensors     per quantized layer (Model Optimizer's `NVFP4QTensor` names and layout):
        NVFP4  <layer>.weight uint8 [N, K/2] (two E2M1 codes a byte, even element low),
               <layer>.weight_scale float8_e4m3fn [N, K/16], <layer>.weight_scale_2 float32 [] (= amax/2688),
               <layer>.input_scale float32 [] for W4A4 (activation amax / 2688)
        FP8    <layer>.weight float8_e4m3fn [N, K], <layer>.weight_scale float32 [], <layer>.input_scale
        routed experts stored stacked ([E, I, H] up_proj, [E, H, I] down_proj) are written one NVFP4 layer
               per expert and projection, as Model Optimizer exports Nemotron-H: <experts>.{j}.up_proj.weight,
               .weight_scale, .weight_scale_2 (and the same for down_proj)
        everything else in BF16 (embeddings, norms, layers a recipe keeps in BF16)

Model Optimizer's names for the formats: "NVFP4" (W4A4), "W4A16_NVFP4", "FP8"; one format for the whole
model is written as its quant_algo, several as "MIXED_PRECISION" with a per-layer "quantized_layers" map.
Layers left in BF16 are listed in "exclude_modules".
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minispec.quant import nvfp4
from minispec.quant.api import formats_of, linear_layers, packed_state
from minispec.quant.modules import EXPERT_WEIGHTS, PackedLinear, is_stacked_experts

ALGO = {"w4a16": "W4A16_NVFP4", "w4a4": "NVFP4", "fp8": "FP8"}
FORMAT_OF_ALGO = {v: k for k, v in ALGO.items()}


def per_expert_names(name: str, experts) -> list[str]:
    """The layer names Model Optimizer gives the experts of a stacked experts module: <name>.{j}.up_proj, ..."""
    return [f"{name}.{j}.{w}" for j in range(experts.up_proj.shape[0]) for w in EXPERT_WEIGHTS]


def quantization_config(model) -> dict:
    formats = {}
    for name, fmt in formats_of(model).items():
        module = model.get_submodule(name)
        if is_stacked_experts(module):
            formats.update(dict.fromkeys(per_expert_names(name, module), fmt))
        else:
            formats[name] = fmt
    used = {f for f in formats.values() if f != "bf16"}
    if not used:
        raise ValueError("the model has no quantized layer: run minispec.quant.quantize first")
    cfg = {"quant_method": "modelopt", "kv_cache_quant_algo": None,
           "exclude_modules": [n for n, f in formats.items() if f == "bf16"]}
    if len(used) == 1:
        (fmt,) = used
        cfg["quant_algo"] = ALGO[fmt]
        if fmt != "fp8":
            cfg["group_size"] = 16
    else:
        cfg["quant_algo"] = "MIXED_PRECISION"
        cfg["quantized_layers"] = {n: {"quant_algo": ALGO[f], **({"group_size": 16} if f != "fp8" else {})}
                                   for n, f in formats.items() if f != "bf16"}
    return cfg


def save_quantized(model, folder) -> Path:
    """Write `model` (quantized in place by minispec.quant.quantize) to `folder`; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    qcfg = quantization_config(model)
    config = model.config.to_dict()
    config["quantization_config"] = qcfg
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "minispec", "format": "modelopt-compatible"},
         "quantization": {k: v for k, v in qcfg.items() if k != "quant_method"}}, indent=1))
    state = {k: v.contiguous() for k, v in packed_state(model).items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    return folder


def layer_formats(qcfg: dict, names) -> dict[str, str]:
    """name -> minispec format of every linear layer named in `names`, from a quantization_config."""
    if qcfg.get("quant_method") != "modelopt":
        raise ValueError(f"not a Model Optimizer checkpoint: quant_method={qcfg.get('quant_method')!r}")
    algo = qcfg.get("quant_algo")
    exclude = set(qcfg.get("exclude_modules") or [])
    if algo == "MIXED_PRECISION":
        layers = qcfg.get("quantized_layers", {})
        unknown = {v["quant_algo"] for v in layers.values()} - set(FORMAT_OF_ALGO)
        if unknown:
            raise ValueError(f"unsupported quant_algo {sorted(unknown)}; minispec reads {sorted(FORMAT_OF_ALGO)}")
        return {n: FORMAT_OF_ALGO[layers[n]["quant_algo"]] if n in layers else "bf16" for n in names}
    if algo not in FORMAT_OF_ALGO:
        raise ValueError(f"unsupported quant_algo {algo!r}; minispec reads {sorted(FORMAT_OF_ALGO)} "
                         "and MIXED_PRECISION")
    return {n: "bf16" if n in exclude else FORMAT_OF_ALGO[algo] for n in names}


def load_quantized(folder, dtype: torch.dtype = torch.float32):
    """A causal LM from a folder `save_quantized` (or Model Optimizer, for these formats) wrote.

    Quantized layers become PackedLinear (packed weights, dequantized inside the W4A16 GEMM); routed experts
    stored per expert are dequantized back into their stacked weights (minispec has no grouped NVFP4 GEMM:
    they compute with the exact Ŵ, but take BF16-class memory); the other tensors load into the model,
    computed in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    qcfg = raw.pop("quantization_config", None)
    if qcfg is None:
        raise ValueError(f"{folder}/config.json has no quantization_config: not a quantized checkpoint")
    config = AutoConfig.for_model(**raw)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    state = load_file(folder / "model.safetensors")
    experts = {n: m for n, m in model.named_modules() if is_stacked_experts(m)}
    expert_formats = layer_formats(qcfg, [e for n, m in experts.items() for e in per_expert_names(n, m)])
    for name, module in experts.items():
        for w in EXPERT_WEIGHTS:
            E, N, K = getattr(module, w).shape
            layers = [f"{name}.{j}.{w}" for j in range(E)]
            if all(expert_formats[layer] == "bf16" for layer in layers):
                continue
            if any(expert_formats[layer] != "w4a16" for layer in layers):
                raise ValueError(f"{folder}: the experts of {name} must all be W4A16_NVFP4 or all BF16")
            state[f"{name}.{w}"] = torch.stack([nvfp4.NVFP4Tensor(
                state.pop(f"{layer}.weight"), state.pop(f"{layer}.weight_scale"),
                state.pop(f"{layer}.weight_scale_2").float().reshape(()), (N, K)).dequantize() for layer in layers])
    formats = layer_formats(qcfg, list(linear_layers(model)))
    for name, fmt in formats.items():
        if fmt == "bf16":
            continue
        old = model.get_submodule(name)
        prefix = name + "."
        tensors = {k[len(prefix):]: state.pop(k) for k in list(state) if k.startswith(prefix)}
        if "weight" not in tensors:
            raise ValueError(f"{folder}: quantized layer {name} has no packed weight")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                PackedLinear(fmt, tensors, old.in_features, old.out_features))
    if "lm_head" in formats and formats["lm_head"] != "bf16":
        model.config.tie_word_embeddings = False
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    packed = {n for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    missing = [k for k in missing if k.rpartition(".")[0] not in packed
               and not (k == "lm_head.weight" and "lm_head" not in packed)]
    if missing or unexpected:
        raise ValueError(f"{folder}: tensors missing {missing[:5]} / unexpected {unexpected[:5]}")
    return model
