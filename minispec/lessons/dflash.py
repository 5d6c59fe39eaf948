"""The pieces of notebook 02 (DFlash) that are library code: its figures, one verify step under each
drafting rule, and a short live training run with tau measured on validation prompts while it trains.

The drafter's two policies themselves live in `minispec.dflash.drafter` (`DFlashDrafter(...,
policy="argmax" | "sample")`): both exact, and which accepts more is measured, not assumed.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

import minispec as ms
from minispec.costs import DFlashParamCount
from minispec.dflash import mask as dmask
from minispec.dflash.config import FULL
from minispec.dflash.drafter import DFlashDrafter

SLIDING_COLOR, FULL_COLOR, TAP_COLOR = "#9ecae1", "#3182bd", "#e6550d"


def _plt():
    import matplotlib.pyplot as plt

    return plt


def tap_map(models: Mapping[str, tuple[Sequence[str], Sequence[int]]]):
    """One row of boxes per model: its layers, sliding (light) or full attention (dark), taps outlined.

    models: {name: (layer_types, target_layer_ids)}.
    """
    plt = _plt()
    fig, axes = plt.subplots(len(models), 1, figsize=(10, 1.1 * len(models) + 0.4), squeeze=False)
    for ax, (name, (types, taps)) in zip(axes[:, 0], models.items()):
        for i, kind in enumerate(types):
            tapped = i in taps
            ax.add_patch(plt.Rectangle((i, 0), 0.9, 1, color=FULL_COLOR if kind == FULL else SLIDING_COLOR,
                                       ec=TAP_COLOR if tapped else "none", lw=2.5 if tapped else 0))
            if tapped:
                ax.text(i + 0.45, 1.15, str(i), ha="center", va="bottom", fontsize=8, color=TAP_COLOR)
        ax.set_xlim(-0.2, len(types))
        ax.set_ylim(0, 1.7)
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=SLIDING_COLOR), plt.Rectangle((0, 0), 1, 1, color=FULL_COLOR),
               plt.Rectangle((0, 0), 1, 1, fc="white", ec=TAP_COLOR, lw=2.5)]
    fig.legend(handles, ["sliding window", "full attention", "tapped (number = layer id)"], loc="lower center",
               ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def param_budget(counts: Mapping[str, DFlashParamCount]):
    """Share of each drafter's parameters in fc, the decoder layers and the output head (stacked bars)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.7 * len(counts) + 1.2))
    parts = [("fc + norms", lambda c: c.fc + c.hidden_norm + c.norm), ("decoder layers", lambda c: c.layers),
             ("output head", lambda c: c.lm_head + c.embed_tokens)]
    colors = ["#fdae6b", "#6baed6", "#756bb1"]
    for row, (name, c) in enumerate(counts.items()):
        left = 0.0
        for (label, part), color in zip(parts, colors):
            share = part(c) / c.total
            ax.barh(row, share, left=left, color=color, label=label if row == 0 else None)
            if share > 0.06:
                ax.text(left + share / 2, row, f"{share:.0%}", ha="center", va="center", fontsize=9)
            left += share
        ax.text(1.01, row, f"{c.total:,}", va="center", fontsize=9)
    ax.set_yticks(range(len(counts)), list(counts))
    ax.set_xlim(0, 1.2)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0], ["0", "25%", "50%", "75%", "100%"])
    ax.legend(loc="upper center", bbox_to_anchor=(0.45, -0.25), ncol=3, frameon=False)
    ax.set_title("where a DFlash drafter's parameters are (total on the right)")
    fig.tight_layout()
    return fig


def mask_figure(seq_len: int = 20, anchors: Sequence[int] = (3, 9, 14), block_size: int = 4,
                window: int | None = None, padding_blocks: int = 1):
    """The training mask of one sequence as a heatmap: rows = block queries, columns = [context ; blocks]."""
    plt = _plt()
    a = torch.tensor([list(anchors) + [0] * padding_blocks])
    valid = torch.tensor([[True] * len(anchors) + [False] * padding_blocks])
    allow = dmask.training_mask(a, valid, seq_len, block_size, window)[0]
    Q = allow.shape[0]
    fig, ax = plt.subplots(figsize=(0.22 * (seq_len + Q) + 1.5, 0.22 * Q + 1.2))
    ax.imshow(allow.float().numpy(), cmap="Blues", vmin=0, vmax=1.3, aspect="equal")
    ax.axvline(seq_len - 0.5, color="black", lw=1)
    for j in range(1, Q // block_size):
        ax.axhline(j * block_size - 0.5, color="grey", lw=0.5)
    for j, anchor in enumerate(anchors):
        ax.plot(anchor, j * block_size - 0.3, marker="v", color=TAP_COLOR, markersize=6)
    ax.set_xticks([seq_len / 2 - 0.5, seq_len + Q / 2 - 0.5], [f"context rows 0..{seq_len - 1}", "block rows"])
    ax.set_yticks([j * block_size + block_size / 2 - 0.5 for j in range(Q // block_size)],
                  [f"block @ {x}" for x in anchors] + ["padding"] * padding_blocks)
    ax.set_title("training mask (dark = may attend; ▼ = the anchor's own context row, which it may NOT see)")
    fig.tight_layout()
    return fig


def verify_draws(p: torch.Tensor, q: torch.Tensor, rule: str, n: int = 40_000,
                 seed: int = 0) -> tuple[torch.Tensor, float]:
    """One verify step drawn n times: (distribution of the first emitted token [V], acceptance rate).

    p, q: [V] target and draft distributions. rule:
      "argmax, one-hot"   draft = argmax q, verifier treats it as deterministic (the "argmax" policy)
      "sampled, one-hot"  draft ~ q, verifier still treats it as deterministic (accept with p(d))
      "sampled, told q"   draft ~ q, verifier told q (accept with min(1, p(d) / q(d)); the "sample" policy)
    Each is exact: given the draft, a one-hot step reproduces p, and a mixture of exact steps is exact.
    They differ in acceptance: p(argmax q), sum_d q(d) p(d) <= max p, and sum min(p, q) = 1 - TV. Which of
    the first and the last is larger depends on p and q: 1 - TV reaches 1 when q = p, while the argmax never
    gets past max p; the argmax wins when q is far from p but still has p's argmax (a peaked p, a flatter q).
    """
    from minispec.speculative.verify import verify

    g = torch.Generator().manual_seed(seed)
    p, q = torch.as_tensor(p, dtype=torch.float32), torch.as_tensor(q, dtype=torch.float32)
    if rule == "argmax, one-hot":
        drafts = q.argmax().expand(n)
    elif rule in ("sampled, told q", "sampled, one-hot"):
        drafts = torch.multinomial(q, n, replacement=True, generator=g)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    told = q.expand(n, 1, -1) if rule == "sampled, told q" else None
    res = verify(drafts[:, None], p.expand(n, 2, -1), told, generator=g)
    return torch.bincount(res.tokens[:, 0], minlength=len(p)).double() / n, float(res.accepted.float().mean())


def rules_figure(p, q, results: Mapping[str, torch.Tensor], labels=None):
    """Grouped bars: the target p, the draft q and the emitted-token distribution under each rule."""
    plt = _plt()
    bars = {"target p": torch.as_tensor(p, dtype=torch.float64), "draft q": torch.as_tensor(q, dtype=torch.float64),
            **results}
    V = len(bars["target p"])
    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(bars)
    colors = ["black", "#bdbdbd", "#31a354", "#3182bd", "#de2d26"]
    for i, ((name, values), color) in enumerate(zip(bars.items(), colors)):
        ax.bar([v + (i - len(bars) / 2 + 0.5) * width for v in range(V)], values.tolist(), width, label=name,
               color=color)
    ax.set_xticks(range(V), labels or [str(v) for v in range(V)])
    ax.set_ylabel("probability")
    ax.set_title("first emitted token: which rules reproduce the target?")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def validation_tau(target, drafter, prompts, max_new_tokens: int = 48) -> float:
    """Greedy tau of `drafter` over `prompts` (one batch)."""
    return ms.speculative_generate(target, drafter, prompts, max_new_tokens).stats.tau


def live_training(target, tokenizer, steps: int = 40, eval_every: int = 10, replies: int = 48,
                  val_prompts: int = 4, seed: int = 0, work_dir=None, loss_plot=None,
                  tau_plot=None) -> tuple[object, list[dict]]:
    """Train a fresh bolt-mini drafter for a few steps on the target's greedy replies, measuring greedy
    tau on held-out prompts every `eval_every` steps; returns (drafter model, [{"step", "tau", "loss"}]).
    `loss_plot` (series "loss") gets every step, `tau_plot` (series "tau") every evaluation."""
    import tempfile

    from minispec.dflash.config import bolt_mini_dflash_config
    from minispec.dflash.model import DFlashDraftModel
    from minispec.dflash.train import Settings, train
    from minispec.targets.replies import generate_replies

    s = Settings(steps=steps, batch=4, num_anchors=24, greedy_replies=replies, sampled_replies=0, prompt_len=64,
                 reply_len=96, lr=3e-3, warmup=5, ckpt_every=steps, seed=seed)
    data = generate_replies(target, tokenizer, s.greedy_replies, s.prompt_len, s.reply_len, seed=seed)
    prompts = ms.load_evalset().prompts[-val_prompts:]  # the shipped drafter's eval set, read only
    torch.manual_seed(seed)
    model = DFlashDraftModel.for_target(bolt_mini_dflash_config(), target)
    log: list[dict] = []

    def on_step(step: int, record: dict) -> None:
        if loss_plot is not None:
            loss_plot.add(step + 1, loss=record["loss"])
        if (step + 1) % eval_every and step != 0:
            return
        tau = validation_tau(target, DFlashDrafter(model, target), prompts)
        log.append({"step": step + 1, "tau": tau, "loss": record["loss"]})
        if tau_plot is not None:
            tau_plot.add(step + 1, tau=tau)

    train(model, target, data, s, work_dir or tempfile.mkdtemp(), on_step=on_step, desc="live dflash")
    return model, log
