"""The pieces of notebook 02 (DFlash) that are library code: its figures (the tap map, the parameter budget,
the training mask, the closing speed figure), one verify step under each drafting rule, and a short live
training run with tau measured on validation prompts while it trains.

The drafter's two policies themselves live in `minispec.dflash.drafter` (`DFlashDrafter(...,
policy="argmax" | "sample")`): both exact, and which accepts more is measured, not assumed.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

import minispec as ms
from minispec import costs
from minispec.costs import DFlashParamCount
from minispec.dflash import mask as dmask
from minispec.dflash.config import FULL, SLIDING
from minispec.dflash.drafter import DFlashDrafter

SLIDING_COLOR, FULL_COLOR, TAP_COLOR = "#9ecae1", "#3182bd", "#e6550d"

# Bolt E4B's target as the Bolt E4B write-up describes it: 42 layers, one full-attention layer after every five
# sliding-window ones (35 sliding, 7 full: 5, 11, 17, 23, 29, 35, 41), and its drafter reads the outputs of five
# of the full ones. Full layers 29 and 41 are not tapped; the write-up gives no reason.
E4B_LAYER_TYPES = tuple(FULL if i % 6 == 5 else SLIDING for i in range(42))
E4B_TAPS = (5, 11, 17, 23, 35)


def _plt():
    import matplotlib.pyplot as plt

    return plt


def tap_map(models: Mapping[str, tuple[Sequence[str], Sequence[int]]]):
    """One row of boxes per model: its layers, sliding (light) or full attention (dark), taps outlined.

    models: {name: (layer_types, target_layer_ids)}. Every tapped and every full-attention layer is numbered
    (orange: tapped), so an untapped full layer shows as a dark number.
    """
    plt = _plt()
    fig, axes = plt.subplots(len(models), 1, figsize=(10, 1.1 * len(models) + 0.4), squeeze=False)
    for ax, (name, (types, taps)) in zip(axes[:, 0], models.items()):
        for i, kind in enumerate(types):
            tapped = i in taps
            ax.add_patch(plt.Rectangle((i, 0), 0.9, 1, color=FULL_COLOR if kind == FULL else SLIDING_COLOR,
                                       ec=TAP_COLOR if tapped else "none", lw=2.5 if tapped else 0))
            if tapped or kind == FULL:
                ax.text(i + 0.45, 1.15, str(i), ha="center", va="bottom", fontsize=8,
                        color=TAP_COLOR if tapped else FULL_COLOR)
        ax.set_xlim(-0.2, len(types))
        ax.set_ylim(0, 1.7)
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=SLIDING_COLOR), plt.Rectangle((0, 0), 1, 1, color=FULL_COLOR),
               plt.Rectangle((0, 0), 1, 1, fc="white", ec=TAP_COLOR, lw=2.5)]
    fig.legend(handles, ["sliding window", "full attention", "tapped (orange number = layer id)"],
               loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def param_budget(counts: Mapping[str, DFlashParamCount]):
    """Share of each drafter's parameters in fc, the decoder layers and the output head (stacked bars)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.7 * len(counts) + 1.2))
    parts = [("fc + norms", lambda c: c.fc + c.hidden_norm + c.norm), ("decoder layers", lambda c: c.layers),
             ("output head", lambda c: c.lm_head + c.embed_tokens)]
    colors = ["#fdae6b", "#6baed6", "#756bb1"]
    for row, c in enumerate(counts.values()):
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


def speed_figure(rows: Mapping[str, Mapping[str, float]], max_tau: float = 8.0):
    """The notebook's answer: speedup over plain decoding against tau, one line per target, from the costs of a
    `minispec.bench.dflash.side_by_side` row (C_t, C_d, C_v each timed alone): speedup = tau / tau*, with
    tau* = (C_d + C_v) / C_t the break-even (a circle on the line at 1). A star marks the prediction at the
    measured tau, a diamond the speedup measured in the loop; the gap between them is the loop's own overhead.
    rows: {target name: side_by_side row}.
    """
    if not rows:
        raise ValueError("speed_figure needs at least one side_by_side row")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    taus = torch.linspace(1, max_tau, 50).tolist()
    ax.axhspan(0, 1, color="#de2d26", alpha=0.07, lw=0)
    ax.axhline(1, color="0.4", ls=":", lw=1.2)
    top = 1.0
    for (name, row), color in zip(rows.items(), ("#3182bd", "#31a354", "#756bb1", "#e6550d")):
        missing = {"tau", "speedup", "C_t_ms", "C_d_ms", "C_v_ms"} - set(row)
        if missing:
            raise ValueError(f"row {name!r} lacks {sorted(missing)}: pass rows of minispec.bench.dflash.side_by_side")
        c_t, c_d, c_v, tau = row["C_t_ms"], row["C_d_ms"], row["C_v_ms"], row["tau"]
        tau_star = costs.break_even_tau(c_t, c_d, c_v)
        curve = [costs.speedup(t, c_t, c_d, c_v) for t in taus]
        predicted = costs.speedup(tau, c_t, c_d, c_v)
        ax.plot(taus, curve, color=color, lw=2, label=f"{name}: cost model, break-even τ* = {tau_star:.2f}")
        if tau_star <= max_tau:
            ax.plot([tau_star], [1.0], "o", color=color, mec="white", ms=7)
        ax.plot([tau], [predicted], "*", color=color, ms=14, mec="black", mew=0.5)
        ax.plot([tau], [row["speedup"]], "D", color=color, ms=8, mec="black", mew=0.5)
        ax.plot([tau, tau], [predicted, row["speedup"]], color=color, ls="--", lw=1)
        ax.annotate(f"τ = {tau:.2f}: {predicted:.2f}× predicted, {row['speedup']:.2f}× measured",
                    (tau, row["speedup"]), xytext=(8, -4), textcoords="offset points", fontsize=8, va="top")
        top = max(top, curve[-1], predicted, row["speedup"])
    ax.plot([], [], "*", color="0.3", ms=12, label="predicted at the measured τ")
    ax.plot([], [], "D", color="0.3", ms=7, label="measured in the loop")
    ax.text(max_tau, 0.5, "slower than plain decoding ", ha="right", va="center", fontsize=8, color="#de2d26")
    ax.set_xlim(1, max_tau)
    ax.set_ylim(0, top * 1.1)
    ax.set_xlabel("τ: tokens emitted per target forward")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("does a DFlash drafter make decoding faster? (batch 1, greedy, this machine)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def window_choice(rows: Sequence[Mapping]):
    """How the cost model picks K, from the rows of `minispec.bench.dflash.pick_draft_tokens` (one per K, in a
    bench result: `[r for r in result["rows"] if "picked" in r]`). Left: the τ the held-out acceptance predicts
    at each K, and what a cycle costs in decode steps, (C_d + C_v) / C_t; their ratio, right, is the predicted
    speedup, the picked K starred."""
    if not rows or any("picked" not in r for r in rows):
        raise ValueError("window_choice needs the rows of minispec.bench.dflash.pick_draft_tokens (each with 'picked')")
    plt = _plt()
    ks = [r["K"] for r in rows]
    cycle = [(r["C_d_ms"] + r["C_v_ms"]) / r["C_t_ms"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.plot(ks, [r["expected_tau"] for r in rows], "o-", color="#31a354", label="τ expected (held-out acceptance)")
    left.plot(ks, cycle, "s-", color="#de2d26", label="cycle cost (C_d + C_v) / C_t, in decode steps")
    left.axhline(1, color="0.4", ls=":", lw=1.2)
    left.set_xlabel("K: drafts verified per cycle")
    left.set_title("what a longer window buys, and what it costs")
    left.legend(fontsize=8, loc="lower right")
    right.plot(ks, [r["predicted_speedup"] for r in rows], "o-", color="#3182bd")
    best = next(r for r in rows if r["picked"])
    right.plot([best["K"]], [best["predicted_speedup"]], "*", ms=16, color="#e6550d", mec="black", mew=0.5)
    right.annotate(f"picked: K = {best['K']}, {best['predicted_speedup']:.2f}× predicted",
                   (best["K"], best["predicted_speedup"]), xytext=(10, -14), textcoords="offset points", fontsize=8)
    right.axhline(1, color="0.4", ls=":", lw=1.2)
    right.set_xlabel("K: drafts verified per cycle")
    right.set_ylabel("predicted speedup = τ · C_t / (C_d + C_v)")
    right.set_title("the cost model's pick")
    for ax in (left, right):
        ax.set_xticks(ks)
    fig.tight_layout()
    return fig


def reply_walk(target, drafter: DFlashDrafter, prompt: torch.Tensor, reply: torch.Tensor) -> list[int]:
    """The leading hits of a block anchored at every position of `reply` [R], the target's greedy reply to
    `prompt` [P] (`minispec.dflash.train.reply_runs`): one target forward for the taps, one drafter forward."""
    from minispec.dflash.train import reply_runs

    x = torch.cat([prompt, reply])[None]
    loss_mask = torch.zeros_like(x)
    loss_mask[0, len(prompt):] = 1
    with torch.no_grad():
        features = drafter.model.tap(target(input_ids=x, output_hidden_states=True).hidden_states)
    return reply_runs(drafter.model, x, loss_mask, features)


def walk_figure(walks: Sequence[Sequence[int]], first: int = 64):
    """Blocks at every position of greedy replies (`reply_walk`, one list per reply) against the blocks the loop
    drafts (`mask.walk`: each cycle starts where the last one stopped). Left: the first `first` positions of the
    longest reply, each bar the τ a cycle drafting there would get (1 + its leading hits), the loop's in green.
    Right: how often each τ occurs at every position and where the loop drafts. A hard stretch costs the loop a
    cycle per token and an easy one is crossed in a few, so τ = 1 blocks are over-represented among its cycles and
    its τ (tokens per cycle) sits below the mean over every position."""
    walks = [list(runs) for runs in walks if runs]
    if not walks:
        raise ValueError("walk_figure needs the runs of at least one reply of two tokens or more")
    plt = _plt()
    visits = [dmask.walk(runs) for runs in walks]
    every = [1 + r for runs in walks for r in runs]
    drafted = [1 + runs[i] for runs, seen in zip(walks, visits) for i in seen]
    fig, (one, hist) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [1.6, 1]})
    runs, seen = max(zip(walks, visits), key=lambda pair: len(pair[0]))
    shown = range(min(first, len(runs)))
    one.bar(shown, [1 + runs[i] for i in shown], width=0.9, color="0.8", label="τ of a block drafted there")
    here = [i for i in seen if i < len(shown)]
    one.bar(here, [1 + runs[i] for i in here], width=0.9, color="#31a354", label="where the loop drafts")
    one.set_xlabel("reply position")
    one.set_ylabel("τ = 1 + leading hits")
    one.set_title(f"the first {len(shown)} positions of one held-out reply")
    one.legend(fontsize=8, loc="upper right")
    width = max(every)
    bins = range(1, width + 1)
    for shift, taus, colour, name in ((-0.2, every, "0.6", "at every position"),
                                      (0.2, drafted, "#31a354", "where the loop drafts")):
        hist.bar([b + shift for b in bins], [taus.count(b) / len(taus) for b in bins], width=0.4, color=colour,
                 label=f"{name}: mean τ {sum(taus) / len(taus):.2f}")
    hist.set_xticks(list(bins))
    hist.set_xlabel("τ of the block")
    hist.set_ylabel("share of blocks")
    hist.set_title(f"{len(walks)} replies: the loop, {len(every)} tokens in {len(drafted)} cycles "
                   f"(τ {len(every) / len(drafted):.2f})", fontsize=10)
    hist.legend(fontsize=8, loc="upper right")
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


def training_story(result: Mapping, shipped: str | None = None):
    """Held-out greedy τ against the CPU-hours each training run cost, one point per run of a
    `python -m minispec.dflash.compare` result (e.g. `ms.load_result("smollm2-135m-dflash-runs")`), and a line
    through the evaluations of a run that was evaluated while it trained; `shipped` names the run that ships (drawn
    as a star). Left: every run; right: the short paired runs, magnified, one colour each. Runs of a pair share
    the data, seed and held-out rows, so a point above another at the same CPU bought τ with a choice, not with time."""
    rows = result["rows"]
    if not rows:
        raise ValueError("training_story needs the rows of a minispec.dflash.compare result")
    plt = _plt()
    fig, (whole, pairs) = plt.subplots(1, 2, figsize=(12, 4.2))
    short = [r for r in rows if r["run"] != shipped]
    colours = dict(zip([r["run"] for r in short], itertools.cycle(plt.cm.tab10.colors)))  # close points: a legend
    if not short:
        pairs.set_axis_off()
    for ax, shown in ((whole, rows), (pairs, short)) if short else ((whole, rows),):
        for row in shown:
            star = row["run"] == shipped
            if row.get("curve"):
                hours, taus = zip(*row["curve"])
                ax.plot(hours, taus, "-", color="#e6550d" if star else colours[row["run"]], lw=1.5, zorder=1)
            ax.plot([row["cpu_hours"]], [row["val_tau"]], "*" if star else "o", ms=16 if star else 7,
                    color="#e6550d" if star else colours[row["run"]], mec="black", mew=0.5,
                    label=row["run"] if ax is pairs else None)
            if star:
                ax.annotate(row["run"], (row["cpu_hours"], row["val_tau"]), xytext=(-10, 10),
                            textcoords="offset points", fontsize=8, ha="right")
        ax.axhline(1, color="0.4", ls=":", lw=1.2)
        ax.set_xlim(0, max(r["cpu_hours"] for r in shown) * 1.15)
        ax.set_ylim(0.95 if ax is whole else min(r["val_tau"] for r in shown) - 0.02,
                    max(r["val_tau"] for r in shown) * (1.1 if ax is whole else 1.02))
        ax.set_xlabel("CPU-hours of training (the whole process)")
    whole.set_ylabel("held-out greedy τ (drafted blocks)")
    whole.set_title("every run" if shipped is None else f"every run; the star: {shipped}")
    pairs.set_title("the short paired runs, magnified")
    if short:
        pairs.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return fig
