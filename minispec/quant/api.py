"""`quantize(model, recipe, forward_loop)`: post-training quantization in the shape of Model Optimizer's
`mtq.quantize(model, config, forward_loop)`, and the real storage it implies.

A recipe is data (a dict, JSON-friendly):

    {"name": "aggressive",
     "algorithm": "max" | "mse" | "four_over_six",    how NVFP4 weight block scales are calibrated
     "scales": "dynamic" | "static",                  recomputed every forward, or frozen at calibration
     "rules": [["*lm_head", "w4a16"], ["*", "w4a16"]]} module-name glob -> format, first match wins

Calibration and scales come in the pairs of "NVFP4 quantization and QAD of Nemotron 3.5 Lightning":
max calibration with dynamic scales (max *is* the rule that recomputes them, so QAD sees scales that
follow its weights), MSE and four-over-six with static scales (their per-block choice is a calibration
result: recomputing it every forward would be a different algorithm, and QAD is meant to adapt the
weights to the frozen choice). `scales` defaults to the algorithm's pair; another pair is refused.

Rules apply to the matmul weights: nn.Linear modules (attention, MLP, shared-expert and Mamba in/out
projections, the output head) and stacked routed experts (`model.layers.{i}.mixer.experts`, 3-D up_proj and
down_proj, quantized per expert). Embeddings and norms are not matmuls with a weight to pack; they stay
BF16, as in Model Optimizer's published Nemotron recipes. A module no rule matches stays BF16; a rule with
format "bf16" states an exception explicitly. Unknown formats, unknown keys, and patterns that match no
quantizable module are errors: a typo in a recipe must not silently leave a model unquantized.

Calibration: minispec's weight calibrations (max / MSE / four-over-six) read only the weight tensor, so an
all-w4a16 recipe gives the same model whatever `forward_loop` shows it (Model Optimizer also has weight
calibrations that read activations, e.g. its local-Hessian search; minispec does not implement them).
Activations of w4a4 and fp8 layers are calibrated from the running max |x| over `forward_loop(model)`, which
is required then: that is where a W4A16 checkpoint with FP8 layers, like the Lightning NVFP4 write-up's,
depends on its calibration data.
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
    QuantExperts,
    QuantizedWeights,
    QuantLinear,
    check_finite,
    check_format,
    is_stacked_experts,
)

ALGORITHMS = ("max", "mse", "four_over_six")
# The scale kind each calibration goes with (the Lightning NVFP4/QAD write-up's pairing; see the module doc).
SCALES_OF = {"max": "dynamic", "mse": "static", "four_over_six": "static"}
RECIPE_KEYS = {"name", "algorithm", "scales", "rules", "note"}

# Everything NVFP4, including the output head and attention: the recipe QAD has to rescue.
AGGRESSIVE = {"name": "aggressive", "algorithm": "max", "scales": "dynamic", "rules": [["*", "w4a16"]],
              "note": "every linear layer NVFP4 W4A16, including attention and the (tied) output head"}
# Beside AGGRESSIVE, it measures what the NVFP4 head alone costs (on SmolLM2 the head is tied to the embedding,
# so the embedding then stays exact too).
AGGRESSIVE_HEAD_BF16 = {"name": "aggressive-head-bf16", "algorithm": "max", "scales": "dynamic",
                        "rules": [["lm_head", "bf16"], ["*", "w4a16"]],
                        "note": "the aggressive recipe with the (tied) output head left in BF16, as the "
                                "Super/Lightning paper keeps Super's above NVFP4"}
# The same calibrated as Lightning's QAD recipe is: four-over-six weights, scales frozen from PTQ on.
AGGRESSIVE_HEAD_BF16_4O6 = {"name": "aggressive-head-bf16-4o6", "algorithm": "four_over_six", "scales": "static",
                            "rules": [["lm_head", "bf16"], ["*", "w4a16"]],
                            "note": "aggressive-head-bf16 calibrated with four-over-six, scales frozen during QAD "
                                    "(the Lightning NVFP4/QAD report's pairing)"}
# The same with NVFP4 activations too (W4A4, dynamic activation block scales, calibrated per-tensor amax).
AGGRESSIVE_W4A4 = {"name": "aggressive-w4a4", "algorithm": "max", "scales": "dynamic", "rules": [["*", "w4a4"]],
                   "note": "every linear layer NVFP4 W4A4, including attention and the (tied) output head"}
# Every matmul FP8 W8A8 (per-tensor scales for weights and inputs): the other activation-quantizing tier, and on
# a chat scorecard the 8-bit ceiling an NVFP4 recipe is read against.
ALL_FP8 = {"name": "all-fp8", "algorithm": "max", "rules": [["*", "fp8"]],
           "note": "every linear layer FP8 W8A8, one scale per tensor for weights and inputs"}
# Lightning's published component map (Model Optimizer's recipe for Nemotron-3.5-Lightning-30B-A3B,
# ptq/w4a16_nvfp4_4o6.yaml), transposed onto a dense transformer: MLPs and the head NVFP4 W4A16 with
# four-over-six weights, attention projections BF16.
LIGHTNING_LIKE = {"name": "lightning-like", "algorithm": "four_over_six", "scales": "static",
                  "rules": [["*self_attn*", "bf16"], ["*", "w4a16"]],
                  "note": "Nemotron-3.5-Lightning's map: MLP and head NVFP4 W4A16 4/6, attention BF16"}
# The tiers of "Nemotron 3.5 Super and Lightning: Open, Efficient Mixture-of-Experts Hybrid Mamba-Transformer
# Models for Agentic AI" on a Nemotron-H model (lightning-mini): the matmuls of the routed and shared experts
# (and of a dense MLP layer, where the pattern has one) NVFP4 with four-over-six weights, attention projections
# and Mamba in/out projections FP8 (W8A8: a forward_loop calibrates their inputs), the output head above NVFP4
# (BF16), and everything that is not a matmul weight (embedding, norms, router, conv1d, SSM parameters) BF16.
SUPER_TIERS = {"name": "super-tiers", "algorithm": "four_over_six", "scales": "static",
               "rules": [["*mixer.experts", "w4a16"], ["*mixer.shared_experts.*", "w4a16"],
                         ["*mixer.up_proj", "w4a16"], ["*mixer.down_proj", "w4a16"],
                         ["*mixer.[qkvo]_proj", "fp8"], ["*mixer.in_proj", "fp8"], ["*mixer.out_proj", "fp8"],
                         ["lm_head", "bf16"]],
               "note": "the Super/Lightning paper's tiers: experts and MLPs NVFP4 (4/6), attention and Mamba "
                       "projections FP8, output head BF16"}


def check_recipe(recipe: dict) -> dict:
    """The recipe with defaults filled in, or a ValueError naming what is wrong."""
    if not isinstance(recipe, dict):
        raise ValueError(f"a recipe is a dict with 'rules', got {type(recipe).__name__}")
    unknown = set(recipe) - RECIPE_KEYS
    if unknown:
        raise ValueError(f"unknown recipe keys {sorted(unknown)}; allowed: {sorted(RECIPE_KEYS)}")
    r = {"name": "custom", "algorithm": "max", **recipe}
    if r["algorithm"] not in ALGORITHMS:
        raise ValueError(f"unknown calibration algorithm {r['algorithm']!r}: expected one of {ALGORITHMS}")
    r.setdefault("scales", SCALES_OF[r["algorithm"]])
    if r["scales"] not in SCALE_KINDS:
        raise ValueError(f"scales must be one of {SCALE_KINDS}, got {r['scales']!r}")
    if r["scales"] != SCALES_OF[r["algorithm"]]:
        why = ("max calibration is the rule that recomputes scales from the weights: freezing it would keep "
               "scales that no longer fit the weights QAD moves" if r["algorithm"] == "max" else
               f"{r['algorithm']} picks each block's scale by a search at calibration: recomputing it every "
               "forward would undo that choice (and QAD adapts the weights to the frozen one)")
        raise ValueError(f"recipe {r['name']!r}: algorithm {r['algorithm']!r} goes with scales="
                         f"{SCALES_OF[r['algorithm']]!r}, not {r['scales']!r} (the pairing of the Lightning NVFP4/QAD "
                         f"write-up): {why}")
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


def quantizable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every module holding matmul weights a recipe can quantize, in order: the linear
    layers and the stacked routed experts (quantized or not)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, QuantLinear, PackedLinear, QuantExperts)) or is_stacked_experts(m)}


def assign_formats(model: nn.Module, recipe: dict) -> dict[str, str]:
    """name -> format for every quantizable module, by the first matching rule ("bf16" where none matches)."""
    recipe = check_recipe(recipe)
    names = list(quantizable_modules(model))
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
            raise ValueError(f"recipe {recipe['name']!r}: pattern {pattern!r} (-> {fmt}) matches no linear layer "
                             f"or experts module; module names look like {names[:3]}")
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
    modules = quantizable_modules(model)
    for name, fmt in formats.items():
        if isinstance(modules[name], (QuantizedWeights, PackedLinear)):
            raise ValueError(f"{name} is already quantized; quantize a fresh copy of the model")
        if fmt != "bf16":
            for w_name, w in modules[name].named_parameters(recurse=False):
                if w_name != "bias":
                    check_finite(w.detach(), f"weight {name}.{w_name}")
    quantized = {}
    for name, fmt in formats.items():
        if fmt == "bf16":
            continue
        kind = QuantExperts if is_stacked_experts(modules[name]) else QuantLinear
        q = kind(modules[name], fmt, recipe["scales"])
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
    """name -> format of every quantizable module (linear layers, stacked experts) of a quantized (or plain) model."""
    return {n: getattr(m, "format", "bf16") for n, m in quantizable_modules(model).items()}


def quantized_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The full-precision weights of the quantized matmuls, by parameter name: what QAD trains in the
    Super/Lightning paper ("Nemotron 3.5 Super and Lightning: Open, Efficient Mixture-of-Experts Hybrid
    Mamba-Transformer Models for Agentic AI"), where norms, embeddings, biases and BF16 layers stay as they are.

    `<layer>.weight` of every QuantLinear and `<experts>.up_proj` / `.down_proj` of every QuantExperts, under
    the model's own parameter names (`named_parameters`): a Parameter shared by two modules, like an output
    head tied to its embedding, is listed once, under its first name (`model.embed_tokens.weight`), and
    training it moves both, since they are one tensor."""
    quantized = {id(m.raw(w)) for m in model.modules() if isinstance(m, QuantizedWeights) for w in m.weight_names}
    out = {n: p for n, p in model.named_parameters() if id(p) in quantized}
    if not out:
        raise ValueError("the model has no quantized layer: run minispec.quant.quantize first")
    return out


def save_recipe(recipe: dict, path) -> None:
    Path(path).write_text(json.dumps(check_recipe(recipe), indent=1))


def load_recipe(path) -> dict:
    return check_recipe(json.loads(Path(path).read_text()))


# --- real storage -----------------------------------------------------------------------------------

def packed_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a quantized checkpoint stores: packed weights and scales of quantized layers (Model
    Optimizer's names: `<layer>.weight`, `.weight_scale`, `.weight_scale_2`, `.input_scale`; routed experts
    one such layer per expert and projection, `<experts>.{j}.up_proj.weight` ...), and every other
    parameter and buffer in BF16 (the exceptions). A tied tensor is stored once per precision."""
    out: dict[str, torch.Tensor] = {}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeights)}
    skip = set()
    for name, q in quantized.items():
        packed = q.packed_weight() if isinstance(q, QuantLinear) else q.packed_experts()
        for key, t in packed.items():
            out[f"{name}.{key}"] = t
        skip |= {f"{name}.{k}" for k, _ in q.named_parameters(recurse=False)}
        skip |= {f"{name}.{k}" for k, _ in q.named_buffers(recurse=False)}
    seen, persistent = set(), set(model.state_dict())
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


def param_formats(model: nn.Module) -> dict[str, str]:
    """Parameter name -> its storage tier: the format of the quantized matmul that owns it, "bf16" for every
    other parameter (embeddings, norms, routers, BF16 layers, biases). Tied parameters appear once."""
    tier = {}
    for module in model.modules():
        if isinstance(module, QuantizedWeights):
            for w_name in module.weight_names:
                tier[id(module.raw(w_name))] = module.format
    return {n: tier.get(id(p), "bf16") for n, p in model.named_parameters()}


def params_by_format(model: nn.Module) -> dict[str, int]:
    """Parameters per storage tier (`param_formats`), tied parameters counted once."""
    counts = dict.fromkeys(FORMATS, 0)
    params = dict(model.named_parameters())
    for name, fmt in param_formats(model).items():
        counts[fmt] += params[name].numel()
    return counts


def storage_report(model: nn.Module) -> dict:
    """Measured bytes of the packed checkpoint, split into NVFP4 codes, NVFP4 block scales, FP8, per-tensor
    scales and BF16 exceptions, with bits per parameter (parameters counted once, tied ones too) and the
    parameters of each tier (`params_by_format`)."""
    state = packed_state(model)
    fmt = {n: getattr(m, "format", None) for n, m in model.named_modules()}
    for n, m in model.named_modules():  # the experts' packed tensors are named per expert: <experts>.{j}.up_proj
        if isinstance(m, QuantExperts):
            fmt.update({f"{n}.{j}.{w}": m.format for j in range(m.num_experts) for w in m.weight_names})
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
            "params_by_format": params_by_format(model),
            "formats": {f: sum(1 for v in formats_of(model).values() if v == f) for f in FORMATS}}
