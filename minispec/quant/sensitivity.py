"""Which layers can take 4 bits? Model Optimizer's AutoQuant gradient score, and recipes built from it.

For a linear layer with output Y and a candidate format r, quantize only that layer and look at the
change of its output, ΔY_r = Y_r − Y. A second-order Taylor expansion of the loss in Y, with the Hessian
replaced by the empirical Fisher diag(g²), g = ∂L/∂Y at the unquantized model, gives

    ΔL ≈ ½ Σ_i (g_i · ΔY_r,i)²        score(layer, r) = Σ_batches Σ_i (g_i · ΔY_r,i)²

(Model Optimizer's `AutoQuantizeGradientSearcher`, modelopt/torch/quantization/algorithms.py). One
forward + backward per batch scores every layer and format at once. Scores are then made monotone in
bits (a wider format never scores worse than a narrower one), and a recipe picks one format per layer:
minimum total score under an average-bits budget.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from minispec.quant.api import SCALES_OF, linear_layers
from minispec.quant.modules import FORMATS, QUANTIZED_INPUT, QuantLinear, check_format


def causal_lm_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM on `[B, T]` ids (the L whose gradient weighs ΔY)."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


def sensitivity(model: nn.Module, batches, formats=("w4a16", "w4a4", "fp8"), algorithm: str = "max",
                loss_fn=causal_lm_loss) -> dict[str, dict[str, float]]:
    """AutoQuant gradient scores: {layer name: {format: Σ (∂L/∂Y ⊙ (Y_r − Y))²}} over `batches`.

    model: unquantized; its weights are not changed (gradients are computed and thrown away).
    batches: an iterable of inputs for loss_fn(model, batch). Activation formats (w4a4, fp8) take the
    input's own max |x| of the batch as their calibrated amax.
    """
    for f in formats:
        if check_format(f) == "bf16":
            raise ValueError("bf16 is the unquantized reference (score 0); list only quantized formats")
    layers = linear_layers(model)
    probes = {}
    for name, lin in layers.items():
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{name} is already quantized: score an unquantized model")
        probes[name] = {}
        for f in formats:
            try:
                probe = QuantLinear(copy.deepcopy(lin), f)
            except ValueError:  # NVFP4 on a layer whose K is not a multiple of 16: that format is not a candidate
                continue
            probe.calibrate_weight(algorithm)
            probes[name][f] = probe
    scores = {name: {f: 0.0 for f in probes[name]} for name in layers}

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].detach()
            deltas = {}
            with torch.no_grad():
                for f, probe in probes[name].items():
                    if f in QUANTIZED_INPUT:
                        probe.input_amax = x.abs().amax().float()
                    deltas[f] = probe(x).float() - output.detach().float()

            def on_grad(g):
                for f, d in deltas.items():
                    scores[name][f] += ((g.float() * d).clamp(-1e10, 1e10) ** 2).sum().item()
            if output.requires_grad:
                output.register_hook(on_grad)
        return record

    handles = [layers[n].register_forward_hook(hook(n)) for n in layers]
    flags = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(True)
        with torch.enable_grad():
            for batch in batches:
                loss_fn(model, batch).backward()
                model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
        for p, f in flags.items():
            p.requires_grad_(f)
    return scores


def monotone(scores: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per layer, clamp each format's score to at most that of every narrower format (bf16 scores 0)."""
    out = {}
    for name, by_format in scores.items():
        ordered = sorted([*by_format, "bf16"], key=lambda f: FORMATS[f])
        best, out[name] = float("inf"), {}
        for f in ordered:
            best = min(best, 0.0 if f == "bf16" else by_format[f])
            out[name][f] = best
    return out


def ranking(scores: dict[str, dict[str, float]], fmt: str = "w4a16") -> list[tuple[str, float]]:
    """(layer, score of `fmt`) from most to least sensitive."""
    return sorted(((n, s[fmt]) for n, s in scores.items() if fmt in s), key=lambda t: -t[1])


def effective_bits(formats: dict[str, str], sizes: dict[str, int]) -> float:
    """Average bits per weight over the searched layers: Σ size · bits(format) / Σ size."""
    return sum(sizes[n] * FORMATS[f] for n, f in formats.items()) / sum(sizes[n] for n in formats)


def search_formats(scores: dict[str, dict[str, float]], sizes: dict[str, int], bits_budget: float,
                   formats=("w4a16", "fp8", "bf16")) -> dict[str, str]:
    """One format per layer minimizing Σ score under average bits ≤ bits_budget.

    Model Optimizer solves this integer program with an LP solver; here a greedy on the Lagrangian does it:
    start every layer at its narrowest format, then repeatedly take the upgrade with the largest score drop
    per extra bit that still fits the budget. sizes: layer -> number of weights.
    """
    for f in formats:
        check_format(f)
    mono = monotone(scores)
    cheapest = min(formats, key=lambda f: FORMATS[f])
    if bits_budget < FORMATS[cheapest]:
        raise ValueError(f"bits budget {bits_budget} is below the narrowest candidate "
                         f"({cheapest}: {FORMATS[cheapest]})")
    choice = {n: min((f for f in formats if f in mono[n]), key=lambda f: FORMATS[f]) for n in scores}
    total = sum(sizes.values())
    used = sum(sizes[n] * FORMATS[f] for n, f in choice.items())
    while True:
        best = None
        for n, f in choice.items():
            for g in formats:
                extra = sizes[n] * (FORMATS[g] - FORMATS[f])
                if g not in mono[n] or extra <= 0 or used + extra > bits_budget * total:
                    continue
                gain = (mono[n][f] - mono[n][g]) / extra
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, n, g, extra)
        if best is None:
            return choice
        _, n, g, extra = best
        choice[n], used = g, used + extra


def recipe_from_formats(formats: dict[str, str], name: str, algorithm: str = "four_over_six",
                        note: str = "") -> dict:
    """A recipe of exact-name rules (every layer listed, bf16 ones as explicit exceptions), with the scale kind
    that goes with `algorithm` (`SCALES_OF`)."""
    return {"name": name, "algorithm": algorithm, "scales": SCALES_OF[algorithm],
            "rules": [[n, f] for n, f in formats.items()], "note": note}


def conservative_recipe(model: nn.Module, scores: dict[str, dict[str, float]], bits_budget: float = 6.0,
                        formats=("w4a16", "fp8", "bf16"), algorithm: str = "four_over_six") -> dict:
    """The sensitivity-driven recipe: `search_formats` over the model's linear layers at `bits_budget`."""
    sizes = {n: m.weight.numel() for n, m in linear_layers(model).items()}
    chosen = search_formats(scores, sizes, bits_budget, formats)
    bits = effective_bits(chosen, sizes)
    return recipe_from_formats(chosen, "conservative", algorithm,
                               f"AutoQuant gradient scores, {bits:.2f} effective bits (budget {bits_budget}) over "
                               f"the linear layers, candidates {list(formats)}")
