"""Acceptance pictures: matplotlib figures for the notebooks, and a curve that redraws while a loop runs.

Each function draws into `ax` when given one (for a grid of subplots) and returns the Figure. None
calls plt.show(): a notebook shows a figure once, as the value of its cell.
"""
from __future__ import annotations

import io
import itertools
import time
from collections.abc import Mapping

import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import MaxNLocator

from minispec.speculative.stats import SpecStats

# Okabe–Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9"]
FIGSIZE = (6.4, 3.6)


def axes_or_new(ax=None):
    """The caller's axes, or those of a new figure. A new figure is closed in pyplot at once: the caller
    still gets it back, and Jupyter's inline backend then does not show it a second time at the end
    of the cell."""
    if ax is not None:
        return ax
    fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    plt.close(fig)
    return ax


def finish_axes(ax, title: str, xlabel: str, ylabel: str, legend: bool = True):
    """Title, labels, a light grid and the legend: the one look of every minispec figure. Returns the figure."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    if legend:
        # loc given, even as "best": matplotlib warns into the cell when its search for the best place is
        # slow (a busy CPU), but only where the location was left to its default.
        ax.legend(frameon=False, loc="best")
    return ax.figure


def _floats(values) -> list[float]:
    return torch.as_tensor(values, dtype=torch.float64).flatten().tolist()


def _named(curves) -> dict[str, list[float]]:
    """A dict of named curves, or one unnamed curve, as {label: values}."""
    if isinstance(curves, Mapping):
        return {name: _floats(values) for name, values in curves.items()}
    return {"": _floats(curves)}


def tau_histogram(stats_or_hist, ax=None):
    """How many tokens each verification emitted, with τ (their mean) marked.

    `stats_or_hist`: a SpecStats, or its `histogram` ([K + 2] cycle counts by tokens emitted)."""
    if isinstance(stats_or_hist, SpecStats):
        stats_or_hist = stats_or_hist.histogram
    counts = _floats(stats_or_hist)
    emitted = range(len(counts))
    tau = sum(n * c for n, c in zip(emitted, counts)) / sum(counts)
    ax = axes_or_new(ax)
    # Every verification emits at least the target's own token, so n = 0 is always empty: not drawn.
    bars = ax.bar(emitted[1:], counts[1:], width=0.75, color=PALETTE[0], label="cycles")
    ax.bar_label(bars, fmt="%d", fontsize=8)
    ax.margins(y=0.12)  # room for the counts above the bars
    ax.axvline(tau, color=PALETTE[3], linestyle="--", linewidth=2, label=f"τ = {tau:.2f}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return finish_axes(ax, f"Tokens per verification (τ = {tau:.2f})",
                   "tokens emitted per verification (accepted drafts + 1)", "cycles")


def _rates(curve):
    return curve.per_position if isinstance(curve, SpecStats) else curve


def per_position_acceptance(curves, ax=None):
    """Acceptance rate of draft position k = 1..K, given position k was reached.

    `curves`: one curve (a [K] tensor or list, or a SpecStats) or a dict of labelled ones, e.g.
    {"stale head": ..., "boosted": ...}."""
    rates = {name: _rates(c) for name, c in curves.items()} if isinstance(curves, Mapping) else _rates(curves)
    named = _named(rates)
    ax = axes_or_new(ax)
    for (name, rates), color in zip(named.items(), itertools.cycle(PALETTE)):
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=color, label=name)
    ax.set_ylim(0, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return finish_axes(ax, "Acceptance by draft position", "draft position k",
                   "acceptance rate (k reached)", legend="" not in named)


def acceptance_vs_temperature(temperatures, taus, ax=None):
    """τ against sampling temperature; `taus` is one list of τ or a dict of labelled lists."""
    ax = axes_or_new(ax)
    named = _named(taus)
    temperatures = _floats(temperatures)
    for (name, values), color in zip(named.items(), itertools.cycle(PALETTE)):
        ax.plot(temperatures, values, marker="o", color=color, label=name)
    # τ >= 1 always (the target's own token), so the axis starts at 1: the height above it is the gain.
    ax.set_ylim(bottom=1)
    return finish_axes(ax, "Acceptance length vs temperature", "temperature",
                   "τ (tokens per verification)", legend="" not in named)


def distribution_pair(p, q, ax=None, labels=None):
    """A target distribution p next to a draft distribution q. The hatched part of each pair is
    min(p, q); its total, 1 − TV(p, q), is the chance that a draft sampled from q is accepted
    with probability min(1, p/q).

    `labels`: optional names of the outcomes (e.g. token strings) for the x axis."""
    p, q = _floats(p), _floats(q)
    if len(p) != len(q):
        raise ValueError(f"p and q must have the same length, got {len(p)} and {len(q)}")
    overlap = [min(a, b) for a, b in zip(p, q)]
    x = range(len(p))
    ax = axes_or_new(ax)
    ax.bar([i - 0.2 for i in x], p, width=0.4, color=PALETTE[0], label="p (target)")
    ax.bar([i + 0.2 for i in x], q, width=0.4, color=PALETTE[1], label="q (draft)")
    ax.bar(x, overlap, width=0.8, facecolor="none", edgecolor="0.15", hatch="///", linewidth=0,
           label="min(p, q)")
    ax.set_xticks(list(x), labels if labels is not None else [str(i) for i in x])
    return finish_axes(ax, f"Acceptance = Σ min(p, q) = 1 − TV(p, q) = {sum(overlap):.3f}", "outcome",
                   "probability")


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (not a plain or terminal-IPython run, which can't show images)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def _png(fig):
    from IPython.display import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return Image(data=buffer.getvalue(), format="png")


class LivePlot:
    """Curves that redraw in place while a loop runs in a notebook.

        live = LivePlot("drafter training", "step", "loss", series=["train", "eval"])
        for step in range(steps):
            ...
            live.add(step, train=loss)           # any subset of the series at each x
        live.figure()                            # final picture (the live one catches up too)

    The picture is one output that is replaced, not a new figure per point, and it is redrawn at
    most every `interval` seconds, so drawing does not slow the loop it watches. Outside a Jupyter
    kernel nothing is drawn; `data` is recorded either way.
    """

    def __init__(self, title: str, xlabel: str, ylabel: str, series, interval: float = 0.5):
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.data: dict[str, list[tuple[float, float]]] = {name: [] for name in series}
        self.interval = interval
        self._ax = None
        self._handle = None
        self._shown_at = 0.0
        if _in_kernel():
            from IPython.display import display

            self._handle = display(_png(self._draw()), display_id=True)

    def add(self, x, **values) -> None:
        unknown = values.keys() - self.data.keys()
        if unknown:
            raise ValueError(f"unknown series {sorted(unknown)}; this plot has {list(self.data)}")
        for name, y in values.items():
            self.data[name].append((float(x), float(y)))
        if self._handle is not None and time.monotonic() - self._shown_at >= self.interval:
            self.figure()

    def figure(self):
        """The figure of every point so far; in a notebook the live picture is brought up to date."""
        fig = self._draw()
        if self._handle is not None:
            self._handle.update(_png(fig))
            self._shown_at = time.monotonic()
        return fig

    def _draw(self):
        if self._ax is None:
            self._ax = axes_or_new()
        ax = self._ax
        ax.clear()
        for (name, points), color in zip(self.data.items(), itertools.cycle(PALETTE)):
            if points:
                xs, ys = zip(*points)
                # The latest value in the legend: the number one watches during training.
                ax.plot(xs, ys, color=color, marker="o" if len(xs) < 30 else None, markersize=3,
                        label=f"{name}: {ys[-1]:.4g}")
        return finish_axes(ax, self.title, self.xlabel, self.ylabel, legend=any(self.data.values()))
