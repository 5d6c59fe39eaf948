"""NVFP4 pictures for notebook 04: the E2M1 grid, two-level scales, a block by hand, four-over-six,
static vs dynamic scales, the storage tiers of a hybrid MoE model, sensitivity bars, QAD curves, the
PTQ / QAD recovery of a real model, and the published Lightning and Super QAD figures. Each figure function
draws into `ax` if given and returns the Figure."""
from __future__ import annotations

import torch
from matplotlib.patches import Patch
from torch import nn

from minispec import quant
from minispec.quant import nvfp4
from minispec.quant.modules import QuantLinear
from minispec.viz.plots import PALETTE, axes_or_new, finish_axes

TIER_COLORS = {"w4a16": PALETTE[0], "w4a4": PALETTE[5], "fp8": PALETTE[1], "bf16": PALETTE[3]}

# The published figures, as "NVFP4 quantization and QAD of Nemotron 3.5 Lightning" (the Lightning NVFP4
# write-up) states them. Recoveries in %, benchmark scores in points. For HLE the write-up gives only QAD's
# lead over PTQ, not the scores.
LIGHTNING = {
    "size_gb": {"bf16": 66, "nvfp4": 22},
    # The aggressive W4A16 setting (Mamba linear layers W4A16 instead of FP8, lm_head W4A16, attention BF16),
    # PTQ and QAD checkpoints of the same size.
    "intermediate": {"bf16_gb": 65.85, "quantized_gb": 21.19, "A_qad_steps": 200,
                     "median_recovery": {"A": {"ptq": 96.33, "qad": 99.72}, "B": {"ptq": 95.84, "qad": 98.53}},
                     "A_benchmarks_improved": (10, 11), "A_aime_2025_below_bf16": {"ptq": 3.70, "qad": 0.57},
                     "B_aa_v4_1_index": {"ptq": 20.03, "qad": 23.48}},
    # The released checkpoint: a conservative recipe (MAMBA_MOE_NVFP4_CONSERVATIVE_CFG).
    "final": {"median_recovery": {"ptq": 99.24, "qad": 98.97},
              "scores": {"Terminal-Bench v2.1": {"bf16": 24.44, "ptq": 22.05, "qad": 25.84},
                         "SWE-Bench Multilingual": {"bf16": 37.13, "ptq": 37.00, "qad": 38.07}},
              "qad_minus_ptq": {"Terminal-Bench v2.1": 3.79, "SWE-Bench Multilingual": 1.07, "HLE": 0.65}},
    # The write-up's PTQ study: 1,000 calibration samples, lengths 8K to 128K, 32K best with four-over-six.
    "calibration_study": {"samples": 1000, "shortest": 8192, "longest": 131072, "best_four_over_six": 32768},
    # Its Megatron-LM launcher (megatron_lm_qad.yaml): PTQ with 32 samples of 32,768 tokens, then QAD.
    "launcher": {"calib_size": 32, "seq_len": 32768, "global_batch": 16, "train_samples": 6400,
                 "iterations": 400, "lr": 5e-6, "clip_grad": 1.0},
}
# The QAD figures of "Nemotron 3.5 Super and Lightning: Open, Efficient Mixture-of-Experts Hybrid
# Mamba-Transformer Models for Agentic AI" for Super's released 4.82-bit recipe.
SUPER_QAD = {"best_steps": 200, "worse_steps": 300, "gb200_gpu_hours_per_100_steps": 1024, "recipes_compared": 3,
             "median_recovery": 99.62, "benchmarks": 36, "reply_length_increase": 0.44, "length_increase_cap": 5}


def lightning_checkpoints(ax=None):
    """The Lightning write-up's PTQ and QAD checkpoints in two panels: left, the median score recovery of
    intermediate checkpoints A and B and of the released one; right, the released checkpoint's QAD lead over
    PTQ in points on the three benchmarks the write-up names, with BF16's lead over PTQ where it gives the
    scores. The median says PTQ is ahead; the benchmarks say where QAD pays. With `ax`, a pair of axes."""
    if ax is None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
        plt.close(fig)
    left, right = ax
    medians = dict(LIGHTNING["intermediate"]["median_recovery"], final=LIGHTNING["final"]["median_recovery"])
    names = {"A": "checkpoint A\n(aggressive)", "B": "checkpoint B\n(aggressive)", "final": "released\n(conservative)"}
    for i, stage in enumerate(("ptq", "qad")):
        xs = [k + (i - 0.5) * 0.38 for k in range(len(medians))]
        values = [m[stage] for m in medians.values()]
        left.bar(xs, values, 0.38, color=PALETTE[i], label=stage.upper())
        for x, v in zip(xs, values):
            left.annotate(f"{v:.2f}", (x, v), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
    left.set_xticks(range(len(medians)), [names[k] for k in medians], fontsize=8)
    left.set_ylim(94, 100.6)
    finish_axes(left, "median score recovery vs BF16", "", "%")
    lead = LIGHTNING["final"]["qad_minus_ptq"]
    scores = LIGHTNING["final"]["scores"]
    benchmarks = list(lead)
    right.bar(range(len(benchmarks)), [lead[b] for b in benchmarks], 0.5, color=PALETTE[1], label="QAD − PTQ")
    known = [k for k, b in enumerate(benchmarks) if b in scores]
    right.scatter(known, [scores[benchmarks[k]]["bf16"] - scores[benchmarks[k]]["ptq"] for k in known], marker="_",
                  s=600, lw=3, color="black", zorder=3, label="BF16 − PTQ")
    right.axhline(0, color="grey", lw=0.8)
    right.set_xticks(range(len(benchmarks)), benchmarks, fontsize=8)
    finish_axes(right, "released checkpoint: where QAD pays", "", "points over PTQ")
    return left.figure


def e2m1_grid(ax=None):
    """The 15 distinct E2M1 values on a line, with the round-to-nearest-even decision thresholds."""
    ax = axes_or_new(ax)
    values = sorted(set(nvfp4.E2M1_VALUES))
    ax.scatter(values, [0] * len(values), s=60, color=PALETTE[0], zorder=3, label="E2M1 values")
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for t in ties + [-t for t in ties]:
        ax.axvline(t, color=PALETTE[1], lw=0.8, ls=":")
    ax.plot([], [], color=PALETTE[1], ls=":", label="rounding thresholds (ties go to the even code)")
    for v in values:
        if v >= 0:
            ax.annotate(f"{v:g}", (v, 0), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_yticks([])
    ax.set_ylim(-1, 1)
    return finish_axes(ax, "E2M1: steps of 0.5 below 2, 1 up to 4, then 2 (4 → 6)", "value", "")


def two_level_scales(x: torch.Tensor, ax=None):
    """One row of x [K] (K a multiple of 16): |x|, each block's scale s_b·g·6 (the largest value it can
    hold), and the dequantized values — the per-tensor g sets the range, the E4M3 s_b each block's."""
    ax = axes_or_new(ax)
    t = nvfp4.quantize(x[None].float())
    x_hat = t.dequantize()[0]
    k = torch.arange(len(x))
    ax.bar(k, x.abs(), color=PALETTE[5], width=1.0, label="|x|")
    ax.scatter(k, x_hat.abs(), s=10, color=PALETTE[3], zorder=3, label="|x̂| (dequantized)")
    reach = (t.block_scales.float()[0] * t.global_scale * nvfp4.E2M1_MAX).tolist()
    for b, r in enumerate(reach):
        ax.hlines(r, b * 16 - 0.5, b * 16 + 15.5, color=PALETTE[2], lw=2,
                  label="6 · s_b · g (block range)" if b == 0 else None)
        ax.axvline(b * 16 - 0.5, color="grey", lw=0.5)
    return finish_axes(ax, f"two-level scales: g = {t.global_scale.item():.3g} per tensor, one E4M3 s_b per 16",
                   "element", "magnitude")


def block_by_hand(block: torch.Tensor, global_scale: float | None = None) -> list[dict]:
    """The steps of quantizing one 16-element block, as table rows: x, x / (s_b · g), its E2M1 value,
    the 4-bit code, x̂ and the error. The first row carries a_b, s_b and g."""
    block = block.float().flatten()
    if block.numel() != nvfp4.BLOCK_SIZE:
        raise ValueError(f"a block has {nvfp4.BLOCK_SIZE} elements, got {block.numel()}")
    g = nvfp4.global_scale_from_amax(block.abs().max()) if global_scale is None else torch.tensor(float(global_scale))
    a_b = block.abs().max()
    s_b = nvfp4.block_scales(a_b[None], g)[0]
    scaled = block / (s_b * g)
    q = nvfp4.e2m1_round(scaled.clamp(-6, 6))
    codes = nvfp4.e2m1_encode(q)
    x_hat = q * s_b * g
    rows = []
    for i in range(nvfp4.BLOCK_SIZE):
        rows.append({"x": round(block[i].item(), 5), "x/(s_b·g)": round(scaled[i].item(), 4), "E2M1": q[i].item(),
                     "code": f"{int(codes[i]):04b}", "x̂": round(x_hat[i].item(), 5),
                     "error": round((x_hat[i] - block[i]).item(), 5)})
    rows[0].update({"a_b": round(a_b.item(), 5), "s_b (E4M3)": s_b.item(), "g": g.item()})
    return rows


def four_over_six_errors(n: int = 256, seed: int = 0) -> dict[str, float]:
    """MSE of plain NVFP4 and of four-over-six on an n×n Gaussian, and the fraction of blocks choosing 4."""
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))
    plain = ((nvfp4.quantize(x).dequantize() - x) ** 2).mean().item()
    t = nvfp4.quantize(x, four_over_six=True)
    fos = ((t.dequantize() - x) ** 2).mean().item()
    blocks = x.reshape(n, -1, 16)
    scale_6 = nvfp4.block_scales(blocks.abs().amax(-1), t.global_scale, max_code=6.0)
    chose_4 = (t.block_scales.float() != scale_6).float().mean().item()
    return {"mse_max": plain, "mse_four_over_six": fos, "reduction": 1 - fos / plain, "blocks_choosing_4": chose_4}


def four_over_six_block(block: torch.Tensor, ax=None):
    """One block quantized with max → 6 and with max → 4: the values each grid can hit near the max."""
    ax = axes_or_new(ax)
    block = block.float().flatten()[None]
    g = nvfp4.global_scale_from_amax(block.abs().max(), four_over_six=True)
    blocks = block.reshape(1, 1, 16)
    k = torch.arange(16)
    ax.scatter(k, block[0], color="black", s=25, label="x", zorder=3)
    for code, color in ((6.0, PALETTE[0]), (4.0, PALETTE[3])):
        s = nvfp4.block_scales(blocks.abs().amax(-1), g, max_code=code)
        x_hat = nvfp4.dequantize_blocks(nvfp4.quantize_blocks(blocks, s, g), s, g)[0, 0]
        err = nvfp4.block_squared_error(blocks, s, g).item()
        ax.scatter(k, x_hat, marker="_", s=200, color=color, lw=2, label=f"max → {code:g}: Σ err² = {err:.4f}")
    return finish_axes(ax, "four-over-six keeps whichever grid errs less", "element", "value")


def static_vs_dynamic(weight: torch.Tensor, growth: float = 0.5, steps: int = 11, seed: int = 0, ax=None):
    """What QAD does to scales: the weight [N, K] drifts (grows by up to `growth` and moves by noise of the
    same size), and its NVFP4 reconstruction error ‖Ŵ − W‖² / ‖W‖² is measured with scales frozen at the
    start (static) and recomputed from the current weight (dynamic, global scale included)."""
    ax = axes_or_new(ax)
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    start = weight.detach().clone()
    layers = {kind: QuantLinear(lin, "w4a16", kind) for kind in ("static", "dynamic")}
    for q in layers.values():
        q.calibrate_weight("max")
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * start.std()
    drift = torch.linspace(0, 1, steps)
    errors = {kind: [] for kind in layers}
    with torch.no_grad():
        for t in drift:
            lin.weight.copy_(start * (1 + growth * t) + noise * growth * t)
            w = lin.weight.detach()
            for kind, q in layers.items():
                errors[kind].append(((q.quantized_weight() - w).pow(2).sum() / w.pow(2).sum()).item())
    for i, (kind, e) in enumerate(errors.items()):
        ax.plot(drift * growth, e, marker="o", color=PALETTE[i], label=f"{kind} scales")
    ax.set_yscale("log")
    return finish_axes(ax, "frozen scales stop fitting weights that move", "drift (fraction of the weight's size)",
                       "‖Ŵ − W‖² / ‖W‖²")


def tier_map(model: nn.Module, ax=None):
    """Every parameter of a quantized model by layer, as bars as long as their parameter counts, colored by
    storage tier (NVFP4 / FP8 / BF16): one row for the embedding, one per layer, one for the output head."""
    formats = quant.param_formats(model)
    params = dict(model.named_parameters())
    rows: dict[str, list[tuple[str, int, str]]] = {}
    for name, fmt in formats.items():
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            row, label = f"layer {parts[i + 1]}", ".".join(parts[i + 2:]).replace("mixer.", "")
            kind = getattr(model.get_submodule(".".join(parts[:i + 2])), "block_type", "")
            row += {"linear_attention": " Mamba", "mamba": " Mamba", "full_attention": " attention",
                    "attention": " attention", "moe": " MoE", "mlp": " MLP"}.get(kind, "")
        else:
            row = label = parts[-2] if len(parts) > 1 else name
        rows.setdefault(row, []).append((label, params[name].numel(), fmt))
    if ax is None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.2, 0.42 * len(rows) + 1.2), layout="constrained")
        plt.close(fig)
    widest = max(sum(n for _, n, _ in parts) for parts in rows.values())
    for y, parts in enumerate(reversed(list(rows.values()))):
        left = 0
        for label, n, fmt in sorted(parts, key=lambda t: -t[1]):
            ax.barh(y, n, left=left, color=TIER_COLORS[fmt], edgecolor="white", height=0.7)
            short = label.removesuffix(".weight").replace("shared_experts.", "shared ").replace("_proj", "")
            if n > 0.012 * widest * len(short):  # only where the name fits in its bar
                ax.text(left + n / 2, y, short, ha="center", va="center", fontsize=7, color="white")
            left += n
    ax.set_yticks(range(len(rows)), list(reversed(list(rows))), fontsize=8)
    counts = quant.params_by_format(model)
    total = sum(counts.values())
    names = {"w4a16": "NVFP4", "w4a4": "NVFP4 W4A4", "fp8": "FP8", "bf16": "BF16"}
    handles = [Patch(color=TIER_COLORS[f], label=f"{names[f]}: {counts[f] / total:.0%} of parameters")
               for f in TIER_COLORS if counts[f]]
    ax.legend(handles=handles, loc="center right", fontsize=8)
    return finish_axes(ax, "storage tier of every parameter, layer by layer", "parameters", "", legend=False)


def storage_rows(models: dict[str, nn.Module]) -> list[dict]:
    """One table row per (quantized) model: parameters per tier and the measured bits per parameter."""
    rows = []
    for name, model in models.items():
        r = quant.storage_report(model)
        tiers = r["params_by_format"]
        rows.append({"recipe": name, "NVFP4 params": tiers["w4a16"] + tiers["w4a4"], "FP8 params": tiers["fp8"],
                     "BF16 params": tiers["bf16"], "bits / param": round(r["bits_per_param"], 2),
                     "MB": round(r["total_bytes"] / 1e6, 2)})
    return rows


def recovery_bars(scorecard: dict, ax=None):
    """Recovery (quantized / BF16) of every metric of a scorecard (`minispec.quant.report --scorecard`), PTQ
    next to QAD, beside the BF16-arithmetic floor where the scorecard has it, with 100 % and each row's median
    marked."""
    ax = axes_or_new(ax)
    evaluation = scorecard["evaluation"]
    stages = [s for s in ("bf16-arith", "ptq", "qad") if s in evaluation]
    metrics = [m for m in evaluation["ptq"]["recovery"] if all(m in evaluation[s]["recovery"] for s in stages)]
    width = 0.8 / len(stages)
    colors = {"bf16-arith": "0.6", "ptq": PALETTE[0], "qad": PALETTE[1]}
    labels = {"bf16-arith": "BF16 arithmetic", "ptq": "PTQ", "qad": "QAD"}
    for i, stage in enumerate(stages):
        values = [100 * evaluation[stage]["recovery"][m] for m in metrics]
        label = f"{labels[stage]} (median {100 * evaluation[stage]['median_recovery']:.2f} %)"
        ax.bar([k + (i - (len(stages) - 1) / 2) * width for k in range(len(metrics))], values, width,
               color=colors[stage], label=label)
    ax.axhline(100, color="grey", lw=0.8)
    ax.set_xticks(range(len(metrics)), metrics, rotation=30, ha="right", fontsize=8)
    low = min(100 * evaluation[s]["recovery"][m] for s in stages for m in metrics)
    ax.set_ylim(max(0.0, low - 5), 100 + 13 * len(stages))  # room above 100 % for the legend
    return finish_axes(ax, f"{scorecard['target']}: recovery per metric", "", "recovery vs BF16 (%)")


def sensitivity_bars(scores: dict[str, dict[str, float]], fmt: str = "w4a16", top: int = 20, ax=None):
    """The `top` most sensitive layers by AutoQuant score for `fmt`, log scale, output head highlighted."""
    ranked = sorted(((n, s[fmt]) for n, s in scores.items() if fmt in s), key=lambda t: -t[1])[:top][::-1]
    if ax is None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 0.22 * len(ranked) + 1.2), layout="constrained")
        plt.close(fig)
    names = [n.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "") for n, _ in ranked]
    colors = [PALETTE[3] if "lm_head" in n else PALETTE[0] for n, _ in ranked]
    ax.barh(names, [s for _, s in ranked], color=colors)
    ax.set_xscale("log")
    ax.tick_params(axis="y", labelsize=7)
    return finish_axes(ax, f"AutoQuant score Σ(∂L/∂Y ⊙ ΔY)², {fmt}", "score (log)", "", legend=False)


def qad_curve(history, ax=None, window: int = 10, **baselines):
    """Training KL per step (and its running mean); keyword baselines (e.g. ptq=0.008) as lines."""
    ax = axes_or_new(ax)
    h = torch.tensor(history, dtype=torch.float64)
    ax.plot(h, color=PALETTE[5], lw=0.8, label="KL per step")
    if len(h) >= window:
        smooth = h.unfold(0, window, 1).mean(-1)
        ax.plot(torch.arange(window - 1, len(h)), smooth, color=PALETTE[0], lw=2, label=f"mean of {window}")
    for i, (name, value) in enumerate(baselines.items()):
        ax.axhline(value, color=PALETTE[(i + 1) % len(PALETTE)], ls="--", label=name)
    return finish_axes(ax, "QAD: KL(teacher ‖ student)", "step", "KL (nats / token)")


def markdown_table(rows: list[dict]):
    """Rows of dicts as a Markdown table (an IPython Markdown object in a notebook, else the string)."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    text = "\n".join(lines)
    try:
        from IPython.display import Markdown

        return Markdown(text)
    except ImportError:
        return text
