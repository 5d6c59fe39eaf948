"""Pictures for notebook 03: the recursive MTP head, its train/inference mismatch, and acceptance per position."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from minispec.viz.plots import PALETTE


def _box(ax, x, y, text, color, w=1.5, h=0.55):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.04", fc=color, ec="0.3",
                                alpha=0.9))
    ax.text(x, y, text, ha="center", va="center", fontsize=8)


def _arrow(ax, a, b, color="0.3", style="-|>"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=9, color=color, lw=1.1))


def recursive_head(depths: int = 3):
    """Two panels. A head trained one depth deep: every call reads the backbone's own h (a head trained
    through the recursion, as the Super/Lightning paper's and lightning-mini's are, reads depth k−1's outputs
    in training too). Drafting: depth k reads depth k−1's output, the head's own guess."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
    plt.close(fig)
    for ax, title, mode in zip(axes, ("trained one depth deep: every call reads the backbone's h",
                                      "drafting: depth k reads depth k−1's own output"), ("train", "draft")):
        ax.set_xlim(-0.5, 2.2 * depths + 0.6)
        ax.set_ylim(-0.8, 2.6)
        ax.axis("off")
        ax.set_title(title, fontsize=9)
        for k in range(depths):
            x = 2.2 * k + 1
            _box(ax, x - 0.9, 0, f"h{'' if k == 0 else '′'}$_{{n+{k}}}$" if mode == "draft" else f"h$_{{n+{k}}}$",
                 PALETTE[0] if (mode == "train" or k == 0) else PALETTE[3], w=0.8)
            _box(ax, x, 1.0, f"MTP call {k + 1}\n(shared weights)", "0.9")
            _box(ax, x, 2.1, f"predicts x$_{{n+{k + 2}}}$" if mode == "train" else f"draft d$_{{{k + 1}}}$", PALETTE[2],
                 w=1.1)
            _arrow(ax, (x - 0.9, 0.28), (x - 0.35, 0.72))
            _arrow(ax, (x, 1.28), (x, 1.82))
            if mode == "draft" and k + 1 < depths:
                _arrow(ax, (x + 0.75, 1.0), (2.2 * (k + 1) + 1 - 0.9, 0.28), PALETTE[3])
            tok = f"x$_{{n+{k + 1}}}$" if mode == "train" else ("last" if k == 0 else f"d$_{k}$")
            ax.text(x + 0.25, 0.42, f"+ emb({tok})", fontsize=7, color="0.35", ha="center")
    return fig


def stitched_context(start: int = 4, depths: int = 3):
    """What depth k's attention reads, cache slot by cache slot, when a drafting cycle starts at slot
    `start`: left, drafting (and test-time training, which reproduces it); right, unrolled training
    without mixing. Blue: an entry built from the backbone's hidden state; orange: from the head's own
    output; outlined: the query; grey: not visible."""
    from matplotlib.patches import Patch, Rectangle

    n = start + depths
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.75 * depths + 1.6), layout="constrained")
    plt.close(fig)
    panels = (("drafting = test-time training (stitched context)", "stitched"),
              ("unrolled training without mixing", "unrolled"))
    for ax, (title, mode) in zip(axes, panels):
        for k in range(1, depths + 1):
            query = start + k - 1
            y = depths - k
            for slot in range(n):
                if slot > query:
                    color = "0.9"
                elif mode == "stitched":
                    color = PALETTE[0] if slot <= start else PALETTE[3]
                else:
                    color = PALETTE[0] if k == 1 else PALETTE[3]
                ax.add_patch(Rectangle((slot, y), 0.92, 0.8, fc=color, ec="0.2" if slot == query else "none",
                                       lw=2 if slot == query else 0))
                label = "h" if color == PALETTE[0] else ("d" if color == PALETTE[3] else "")
                ax.text(slot + 0.46, y + 0.4, label, ha="center", va="center", fontsize=7, color="white")
            ax.text(-0.3, y + 0.4, f"depth {k}", ha="right", va="center", fontsize=8)
        ax.set_xlim(-1.6, n + 0.1)
        ax.set_ylim(-0.9, depths + 0.1)
        ax.axis("off")
        ax.set_title(title, fontsize=9)
        ax.annotate("", (start + 0.46, -0.15), (start + 0.46, -0.6), arrowprops={"arrowstyle": "-|>", "color": "0.3"})
        ax.text(start + 0.7, -0.55, "cycle start c (the backbone's h_c)", fontsize=7, color="0.3")
        ax.text(0, -0.55, "cache slots →", fontsize=7, color="0.3")
    fig.legend(handles=[Patch(color=PALETTE[0], label="built from the backbone's hidden state"),
                        Patch(color=PALETTE[3], label="built from the head's own output"),
                        Patch(fc="white", ec="0.2", lw=2, label="the query (depth k at slot c+k−1)")],
               loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return fig


def stand_in_gap(gap: dict, title: str = "what depth k reads instead of the backbone's h"):
    """gap from minispec.mtp.boost.stand_in_gap: cosine and relative error per depth."""
    fig, ax = plt.subplots(figsize=(5.5, 3), layout="constrained")
    plt.close(fig)
    depths = range(1, len(gap["cosine"]) + 1)
    ax.bar([d - 0.2 for d in depths], gap["cosine"].tolist(), 0.4, color=PALETTE[0], label="cosine to h")
    ax.bar([d + 0.2 for d in depths], gap["relative_error"].tolist(), 0.4, color=PALETTE[3],
           label="‖stand-in − h‖ / ‖h‖")
    ax.set_xticks(list(depths))
    ax.set_xlabel("depth k")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def per_position(rows: dict[str, list[float]], title: str = "acceptance per draft position"):
    """rows: name -> per-position acceptance [K]; grouped bars per position."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2), layout="constrained")
    plt.close(fig)
    n = len(rows)
    width = 0.8 / max(n, 1)
    for i, (name, values) in enumerate(rows.items()):
        xs = [k + 1 - 0.4 + width * (i + 0.5) for k in range(len(values))]
        ax.bar(xs, values, width, color=PALETTE[i % len(PALETTE)], label=name)
    K = max(len(v) for v in rows.values())
    ax.set_xticks(range(1, K + 1))
    ax.set_xlabel("draft position (reached)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def al_table(rows: dict[str, dict], modes=("T=0", "T=1 sampled", "T=1 argmax")) -> str:
    """A plain-text table of AL (τ) and per-position acceptance per head and mode
    (rows as returned by minispec.mtp.stages.acceptance, keyed by head name)."""
    cells = {name: [f"τ {row[m]['tau']:.2f} ({' '.join(f'{a:.2f}' for a in row[m]['per_position'])})" for m in modes]
             for name, row in rows.items()}
    widths = [max([len(m)] + [len(c[i]) for c in cells.values()]) for i, m in enumerate(modes)]
    lines = [f"{'head':44s} " + "  ".join(f"{m:>{w}s}" for m, w in zip(modes, widths))]
    lines += [f"{name:44s} " + "  ".join(f"{c:>{w}s}" for c, w in zip(row, widths)) for name, row in cells.items()]
    return "\n".join(lines)


def hsm_study(study: dict, trained_depths: int = 3,
              title: str = "expected acceptance (1 − TV) per depth, held-out replies"):
    """study from minispec.mtp.stages.hsm_study: per arm, the mean over seeds of 1 − TV at each depth with
    one standard error as a bar; depths past `trained_depths` (drafting deeper than training) shaded."""
    import torch

    fig, ax = plt.subplots(figsize=(6.5, 3.4), layout="constrained")
    plt.close(fig)
    labels = {"boost-depth1": "trained at depth 1 only", "boost-hsm": "3 depths, HSM",
              "boost-nohsm": "3 depths, unrolled (no mixing)", "boost-ttt": "3 depths, stitched context (TTT)"}
    for i, (name, runs) in enumerate(study["one_minus_tv"].items()):
        values = torch.tensor(runs)  # [seeds, depths]
        stderr = values.std(0) / len(values) ** 0.5 if len(values) > 1 else torch.zeros(values.shape[1])
        depths = list(range(1, values.shape[1] + 1))
        ax.errorbar(depths, values.mean(0).tolist(), yerr=stderr.tolist(), marker="o", ms=4, capsize=3,
                    color=PALETTE[i % len(PALETTE)], label=labels.get(name, name))
    ax.axvspan(trained_depths + 0.5, len(depths) + 0.5, color="0.93", zorder=0)
    ax.text(trained_depths + 0.6, 0.04, "deeper than the 3-depth runs trained", transform=ax.get_xaxis_transform(),
            fontsize=7, color="0.4")
    ax.set_xticks(depths)
    ax.set_xlabel("depth k (draft position)")
    ax.set_ylabel("1 − TV (mean over seeds)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def study_table(study: dict) -> str:
    """A plain-text table of the study (minispec.mtp.stages.hsm_study): per arm, the mean over seeds ±
    one standard error of 1 − TV at each depth and of each AL."""
    import torch

    runs = study["runs"]
    first = next(iter(runs.values()))[0]
    als = [k for k in first if k.startswith("AL")]
    depths = len(first["one_minus_tv"])

    def cell(values):
        t = torch.tensor(values, dtype=torch.float64)
        err = float(t.std() / len(t) ** 0.5) if len(t) > 1 else float("nan")
        return f"{float(t.mean()):.3f}±{err:.3f}"

    header = [f"1-TV d{d + 1}" for d in range(depths)] + [a[3:] for a in als]
    lines = [f"{'arm':14s} " + " ".join(f"{h:>12s}" for h in header)]
    for name, seeds in runs.items():
        cells = [cell([r["one_minus_tv"][d] for r in seeds]) for d in range(depths)]
        cells += [cell([r[a] for r in seeds]) for a in als]
        lines.append(f"{name:14s} " + " ".join(f"{c:>12s}" for c in cells))
    return "\n".join(lines)
