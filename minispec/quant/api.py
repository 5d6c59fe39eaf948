"""`quantize(model, recipe, forward_loop)`: post-training quantization in the shape of Model Optimizer's
`mtq.quantize(model, config, forward_loop)`, and the real storage it implies.

A recipe is data (a dict, JSON-friendly):

    {"name": "aggressive",
     "algorithm": "max" | "mse" | "four_over_six",    how NVFP4 weight block scales are calibrated
     "scales": "static" | "dynamic",                  frozen block scales, or recomputed every forward
     "rules": [["*lm_head", "w4a16"], ["*", "w4a16"]]} module-name glob -> format, first match wins

Rules apply to nn.Linear modules (embeddings and norms are not matmuls with a weight to pack; they stay
BF16, as in every Nemotron recipe Model Optimizer ships). A module no rule matches stays BF16; a rule
with format "bf16" states an exception explicitly. Unknown formats, unknown keys, and patterns that
match no linear layer are errors: a typo in a recipe must not silently leave a model unquantized.

Calibration: weights are calibrated from themselves (max / MSE / four-over-six); activations of w4a4
and fp8 layers from the running max |x| over `forward_loop(model)`, which is required then.
"""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import torch
from torch import nn

from minispec.quant.modules import (
    FORMATS,
    QUANTIZED_INPUT,
    SCALE_KINDS,
    PackedLinear,
    QuantLinear,
    check_finite,
    check_format,
)

ALGORITHMS = ("max", "mse", "four_over_six")
RECIPE_KEYS = {"name", "algorithm", "scales", "rules", "note"}

# Everything NVFP4, including the output head and attention: the recipe QAD has to rescue.
AGGRESSIVE = {"name": "aggressive", "algorithm": "max", "scales": "static", "rules": [["*", "w4a16"]],
              "note": "every linear layer NVFP4 W4A16, including attention and the (tied) output head"}
# The same with NVFP4 activations too (W4A4, dynamic activation block scales, calibrated per-tensor amax).
AGGRESSIVE_W4A4 = {"name": "aggressive-w4a4", "algorithm": "max", "scales": "static", "rules": [["*", "w4a4"]],
                   "note": "every linear layer NVFP4 W4A4, including attention and the (tied) output head"}
# Lightning's published component map (Model Optimizer's recipe for Nemotron-3.5-Lightning-30B-A3B,
# ptq/w4a16_nvfp4_4o6.yaml), transposed onto a dense transformer: MLPs and the head NVFP4 W4A16 with
# four-over-six weights, attention projections BF16.
LIGHTNING_LIKE = {"name": "lightning-like", "algorithm": "four_over_six", "scales": "static",
                  "rules": [["*self_attn*", "bf16"], ["*", "w4a16"]],
                  "note": "Nemotron-3.5-Lightning's map: MLP and head NVFP4 W4A16 4/6, attention BF16"}


def check_recipe(recipe: dict) -> dict:
    """The recipe with defaults filled in, or a ValueError naming what is wrong."""
    if not isinstance(recipe, dict):
        raise ValueError(f"a recipe is a dict with 'rules', got {type(recipe).__name__}")
    unknown = set(recipe) - RECIPE_KEYS
    if unknown:
        raise ValueError(f"unknown recipe keys {sorted(unknown)}; allowed: {sorted(RECIPE_KEYS)}")
    r = {"name": "custom", "algorithm": "max", "scales": "static", **recipe}
    if r["algorithm"] not in ALGORITHMS:
        raise ValueError(f"unknown calibration algorithm {r['algorithm']!r}: expected one of {ALGORITHMS}")
    if r["scales"] not in SCALE_KINDS:
        raise ValueError(f"scales must be one of {SCALE_KINDS}, got {r['scales']!r}")
    if r["algorithm"] == "mse" and r["scales"] == "dynamic":
        raise ValueError("mse calibration picks static block scales; it cannot be combined with scales='dynamic'")
    rules = r.get("rules")
    if not isinstance(rules, (list, tuple)) or not rules:
        raise ValueError("a recipe needs a non-empty list of [pattern, format] rules")
    for rule in rules:
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"each rule is [pattern, format], got {rule!r}")
        check_format(rule[1])
    r["rules"] = [list(rule) for rule in rules]
    return r


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every nn.Linear (or already-quantized layer) of the model, in order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear, PackedLinear))}


def assign_formats(model: nn.Module, recipe: dict) -> dict[str, str]:
    """name -> format for every linear layer, by the first matching rule ("bf16" where none matches)."""
    recipe = check_recipe(recipe)
    names = list(linear_layers(model))
    used = [False] * len(recipe["rules"])
    formats = {}
    for name in names:
        formats[name] = "bf16"
        for i, (pattern, fmt) in enumerate(recipe["rules"]):
            if fnmatch.fnmatchcase(name, pattern):
                formats[name], used[i] = fmt, True
                break
    for (pattern, fmt), u in zip(recipe["rules"], used):
        if not u and not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"recipe {recipe['name']!r}: pattern {pattern!r} (-> {fmt}) matches no linear layer; "
                             f"layer names look like {names[:3]}")
    return formats


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize(model: nn.Module, recipe: dict, forward_loop=None) -> nn.Module:
    """Quantize `model` in place by `recipe` (see the module doc) and return it.

    forward_loop(model): runs calibration data through the model; needed when a format quantizes
    activations (w4a4, fp8). Non-finite weights are refused before anything is changed.
    """
    recipe = check_recipe(recipe)
    formats = assign_formats(model, recipe)
    layers = linear_layers(model)
    for name, fmt in formats.items():
        if isinstance(layers[name], (QuantLinear, PackedLinear)):
            raise ValueError(f"{name} is already quantized; quantize a fresh copy of the model")
        if fmt != "bf16":
            check_finite(layers[name].weight.detach(), f"weight {name}")
    quantized = {}
    for name, fmt in formats.items():
        if fmt == "bf16":
            continue
        q = QuantLinear(layers[name], fmt, recipe["scales"])
        q.calibrate_weight(recipe["algorithm"])
        _set_submodule(model, name, q)
        quantized[name] = q
    if any(q.format in QUANTIZED_INPUT for q in quantized.values()):
        if forward_loop is None:
            raise ValueError("this recipe quantizes activations (w4a4 / fp8): pass a forward_loop to calibrate them")
        for q in quantized.values():
            q.calibrating = True
        try:
            with torch.no_grad():
                forward_loop(model)
        finally:
            for q in quantized.values():
                q.calibrating = False
        missing = [n for n, q in quantized.items() if q.format in QUANTIZED_INPUT and not q.input_amax > 0]
        if missing:
            raise ValueError(f"forward_loop never reached (or only fed zeros to) {missing[:3]}")
    model.quant_recipe = recipe
    return model


def formats_of(model: nn.Module) -> dict[str, str]:
    """name -> format of every linear layer of a quantized (or plain) model."""
    return {n: getattr(m, "format", "bf16") for n, m in linear_layers(model).items()}


def save_recipe(recipe: dict, path) -> None:
    Path(path).write_text(json.dumps(check_recipe(recipe), indent=1))


def load_recipe(path) -> dict:
    return check_recipe(json.loads(Path(path).read_text()))


# --- real storage -----------------------------------------------------------------------------------

def packed_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a quantized checkpoint stores: packed weights and scales of quantized layers (Model
    Optimizer's names: `<layer>.weight`, `.weight_scale`, `.weight_scale_2`, `.input_scale`), and every
    other parameter and buffer in BF16 (the exceptions). A tied tensor is stored once per precision."""
    out: dict[str, torch.Tensor] = {}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    for name, q in quantized.items():
        for key, t in q.packed_weight().items():
            out[f"{name}.{key}"] = t
    seen, persistent = set(), set(model.state_dict())
    skip = {f"{n}.{k}" for n in quantized for k in ("weight", "bias", "weight_global_scale",
                                                   "weight_block_scale", "input_amax")}
    params = model.named_parameters(remove_duplicate=False)
    for name, t, is_param in [(n, t, True) for n, t in params] + [(n, t, False) for n, t in model.named_buffers()]:
        if name in skip or name in out or name not in persistent:
            continue
        if t.data_ptr() in seen and t.numel():
            continue
        seen.add(t.data_ptr())
        # Weights go to BF16; buffers (Gemma's embed_scale = √H, per-layer scalars) keep their dtype: they are
        # a few numbers, and √192 in BF16 would shift every embedding by 0.1 %.
        out[name] = t.detach().to(torch.bfloat16) if is_param and t.is_floating_point() else t.detach()
    return out


def storage_report(model: nn.Module) -> dict:
    """Measured bytes of the packed checkpoint, split into NVFP4 codes, NVFP4 block scales, FP8, per-tensor
    scales and BF16 exceptions, with bits per parameter (parameters counted once, tied ones too)."""
    state = packed_state(model)
    fmt = {n: getattr(m, "format", None) for n, m in model.named_modules()}
    parts = {"nvfp4_codes": 0, "nvfp4_block_scales": 0, "fp8_weights": 0, "tensor_scales": 0, "bf16": 0}
    for key, t in state.items():
        layer, _, field = key.rpartition(".")
        nbytes = t.numel() * t.element_size()
        f = fmt.get(layer)
        if f in ("w4a16", "w4a4") and field == "weight":
            parts["nvfp4_codes"] += nbytes
        elif f in ("w4a16", "w4a4") and field == "weight_scale":
            parts["nvfp4_block_scales"] += nbytes
        elif f == "fp8" and field == "weight":
            parts["fp8_weights"] += nbytes
        elif f is not None and field in ("weight_scale", "weight_scale_2", "input_scale"):
            parts["tensor_scales"] += nbytes
        else:
            parts["bf16"] += nbytes
    n_params = sum(p.numel() for p in model.parameters())  # parameters() skips duplicates (ties)
    total = sum(parts.values())
    return {**parts, "total_bytes": total, "bf16_bytes": 2 * n_params, "params": n_params,
            "bits_per_param": 8 * total / n_params, "compression": 2 * n_params / total,
            "formats": {f: sum(1 for v in formats_of(model).values() if v == f) for f in FORMATS}}
