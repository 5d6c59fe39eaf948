"""The teaching pieces of notebook 01 (speculative sampling): figures, a widget, small experiments.

    speedup_curve(...)              the cost model, speedup = τ·C_t / (C_d + C_v), with break-even τ*
                                    (speedup_curves: the same numbers as a dict)
    speculative_draws(p, q, n)      n one-draft speculative steps on a toy p and q: what comes out
    emitted_histogram(draws)        their histogram, accepted drafts + residual tokens, against p
    acceptance_figure(p, q, n)      p next to q, and the histogram of emitted tokens next to p
    convergence_figure(p, q, ns)    that histogram after more and more draws
    acceptance_explorer()           sliders that shape p and q (shaped_distribution); the picture redraws
    verification_table(...)         a hand-made `verify` call as a coloured table
    temperature_sweep(...)          τ of several drafters at several temperatures, on real models
    draft_agreement(...)            the acceptance a draft should get: Σ min(p, q) or p(argmax q)
    predicted_acceptance(...)       draft_agreement on the text a sweep generated, per temperature
    rate_table(...)                 numbers by temperature as a plain-text table

Notation as everywhere in minispec: p is the target's distribution, q the drafter's.
"""
from __future__ import annotations

import html
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from minispec import costs
from minispec.speculative import sampling as smp
from minispec.speculative.speculative import SpecGeneration, speculative_generate
from minispec.speculative.stats import ACCEPTED, BONUS, CORRECTION, REJECTED
from minispec.speculative.verify import VerifyResult, acceptance_probability, verify
from minispec.viz.plots import PALETTE, distribution_pair, finish_axes
from minispec.viz.strip import COLORS, LABELS, token_style

# Outcome names for the toy distributions: the corpus is Python, so its most common words.
KEYWORDS = ("def", "return", "self", "if", "for", "in", "import", "None", "not", "else", "class", "with")


def _figure(ncols: int = 1, width: float = 6.4, height: float = 3.6, sharey: bool = False):
    """A new figure and its axes, closed in pyplot at once (as plots.py does): the caller shows it."""
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), layout="constrained", sharey=sharey, squeeze=False)
    plt.close(fig)
    return fig, list(axes[0])


def _png_bytes(fig, dpi: int = 90) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _distribution(x, name: str) -> torch.Tensor:
    """A 1-D float64 tensor of probabilities, normalised (toy inputs may be typed by hand)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.dim() != 1 or x.numel() < 2:
        raise ValueError(f"{name} must be a 1-D distribution over at least 2 outcomes, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all() or (x < 0).any() or x.sum() <= 0:
        raise ValueError(f"{name} must be finite, non-negative and not all zero, got {x.tolist()}")
    return x / x.sum()


def tv_distance(a, b) -> float:
    """Total variation distance ½ Σ |a − b| between two distributions (0 = equal, 1 = disjoint)."""
    return 0.5 * float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().sum())


# ---------------------------------------------------------------------------------------------
# (a) Why drafting helps: the cost model


def speedup_curves(taus: Sequence[float], draft_costs: Sequence[float], c_target: float = 1.0,
                   c_verify: float = 1.0) -> dict[float, list[float]]:
    """`costs.speedup` on a grid: {C_d: [speedup at each τ]}, in units where a plain decode step costs C_t."""
    return {c_d: [costs.speedup(t, c_target, c_d, c_verify) for t in taus] for c_d in draft_costs}


def speedup_curve(draft_costs: Sequence[float] = (0.0, 0.25, 0.5, 1.0), c_target: float = 1.0,
                  c_verify: float = 1.0, max_tau: float = 5.0, marks: Mapping[str, tuple[float, float]] | None = None,
                  ax=None):
    """Speedup over plain decoding against τ, one line per drafting cost C_d (per cycle).

    speedup = τ·C_t / (C_d + C_v). Each line crosses 1 at its break-even τ* = (C_d + C_v) / C_t:
    below τ*, speculation is slower than not speculating (the shaded band).
    `marks`: {label: (τ, C_d)}, measured drafters drawn as stars on the model's prediction.
    """
    if max_tau <= 1:
        raise ValueError(f"max_tau must be > 1 (τ >= 1 always), got {max_tau}")
    if ax is None:
        ax = _figure()[1][0]
    taus = torch.linspace(1, max_tau, 81).tolist()
    curves = speedup_curves(taus, draft_costs, c_target, c_verify)
    top = max(max(v) for v in curves.values())
    ax.axhspan(0, 1, color=PALETTE[3], alpha=0.07, linewidth=0)
    ax.axhline(1, color="0.4", linestyle=":", linewidth=1.2)
    ax.text(max_tau, 0.5, "slower than plain decoding ", ha="right", va="center", fontsize=8, color=PALETTE[3])
    for (c_d, values), color in zip(curves.items(), PALETTE):
        tau_star = costs.break_even_tau(c_target, c_d, c_verify)
        ax.plot(taus, values, color=color, linewidth=2, label=f"C_d = {c_d:.3g}·C_t   (τ* = {tau_star:.2f})")
        if 1 <= tau_star <= max_tau:
            ax.plot([tau_star], [1.0], "o", color=color, markersize=6, markeredgecolor="white")
    for label, (tau, c_d) in (marks or {}).items():
        s = costs.speedup(tau, c_target, c_d, c_verify)
        ax.plot([tau], [s], "*", color="black", markersize=13, zorder=5)
        # below right of the star: the lines rise to the right, so that corner is free
        ax.annotate(f"{label}: τ = {tau:.2f} → {s:.2f}×", (tau, s), xytext=(9, -5), textcoords="offset points",
                    fontsize=8, va="top", bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8})
        top = max(top, s)
    ax.set_xlim(1, max_tau)
    ax.set_ylim(0, top * 1.08)
    return finish_axes(ax, f"Speedup = τ·C_t / (C_d + C_v), with C_v = {c_verify:g}·C_t",
                   "τ: tokens emitted per target forward", "speedup over plain decoding")


# ---------------------------------------------------------------------------------------------
# (b) Acceptance min(1, p/q): many one-draft steps on a toy vocabulary


@dataclass
class Draws:
    """What n independent one-draft speculative steps emitted, split by how each token came out."""
    p: torch.Tensor  # [V] target distribution
    q: torch.Tensor  # [V] the distribution the drafts came from (one-hot for argmax drafts)
    accepted: torch.Tensor  # [V] long: emitted tokens that were accepted drafts
    resampled: torch.Tensor  # [V] long: emitted tokens drawn from the residual after a rejection

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    @property
    def counts(self) -> torch.Tensor:
        return self.accepted + self.resampled

    @property
    def frequencies(self) -> torch.Tensor:
        return self.counts.double() / self.n

    @property
    def acceptance_rate(self) -> float:
        """Measured; its expectation is Σ min(p, q) = 1 − TV(p, q)."""
        return float(self.accepted.sum()) / self.n

    @property
    def tv(self) -> float:
        """TV(empirical histogram, p): shrinks like 1/√n if the emitted tokens follow p."""
        return tv_distance(self.frequencies, self.p)


def speculative_draws(p, q, n: int, seed: int = 0, argmax_draft: bool = False) -> Draws:
    """Run n independent one-draft speculative steps with target p and draft q, all in one `verify` call.

    Each step draws x ~ q (or takes x = argmax q when `argmax_draft`, a deterministic drafter:
    one-hot q), accepts it with probability min(1, p(x)/q(x)), and otherwise emits a token from the
    residual norm(max(p − q, 0)). The first emitted token of each step is counted; exact speculative
    sampling makes its distribution p, whatever q is. p, q: [V] (normalised here). Seeded.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    p, q = _distribution(p, "p").float(), _distribution(q, "q").float()
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same length, got {len(p)} and {len(q)}")
    V = len(p)
    g = torch.Generator().manual_seed(seed)
    if argmax_draft:
        q = F.one_hot(q.argmax(), V).float()
        drafts, draft_probs = torch.full((n, 1), int(q.argmax())), None
    else:
        drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
        draft_probs = q.expand(n, 1, V)
    # K = 1: position 0 judges the draft, position 1 would give the bonus token (not counted here).
    res = verify(drafts, p.expand(n, 2, V), draft_probs, generator=g)
    first, kept = res.tokens[:, 0], res.accepted == 1
    return Draws(p.double(), q.double(), torch.bincount(first[kept], minlength=V),
                 torch.bincount(first[~kept], minlength=V))


def emitted_histogram(draws: Draws, ax=None, labels=None):
    """The histogram of emitted tokens as stacked bars, accepted drafts below and residual tokens on top,
    against p (black bars). As n grows the accepted part tends to min(p, q), the residual part to
    max(p − q, 0), and their sum to p."""
    if ax is None:
        ax = _figure()[1][0]
    V = len(draws.p)
    x = list(range(V))
    acc = (draws.accepted.double() / draws.n).tolist()
    res = (draws.resampled.double() / draws.n).tolist()
    ax.bar(x, acc, width=0.7, color=COLORS[ACCEPTED], alpha=0.85, label="accepted draft")
    ax.bar(x, res, width=0.7, bottom=acc, color=COLORS[CORRECTION], alpha=0.85, label="from residual")
    ax.hlines(draws.p.tolist(), [i - 0.42 for i in x], [i + 0.42 for i in x], color="black", linewidth=2.2,
              label="p (target)")
    ax.set_xticks(x, labels if labels is not None else [str(i) for i in x])
    ax.set_ylim(0, max(max(draws.p.tolist()), max(a + r for a, r in zip(acc, res))) * 1.15)
    title = f"{draws.n:,} draws: accepted {draws.acceptance_rate:.1%}, TV(histogram, p) = {draws.tv:.3f}"
    return finish_axes(ax, title, "emitted token", "frequency")


def _acceptance_figure(draws: Draws, labels=None):
    fig, (left, right) = _figure(2, width=11.5, height=3.8)
    distribution_pair(draws.p, draws.q, ax=left, labels=labels)
    emitted_histogram(draws, ax=right, labels=labels)
    return fig


def _labels(V: int) -> list[str]:
    return list(KEYWORDS[:V]) if V <= len(KEYWORDS) else [str(i) for i in range(V)]


def acceptance_figure(p, q, n: int = 1000, seed: int = 0, argmax_draft: bool = False, labels=None):
    """The explorer's picture without a kernel: p next to q with their overlap min(p, q) (left), and the
    histogram of n speculative draws next to p (right). `labels` default to Python keywords."""
    draws = speculative_draws(p, q, n, seed, argmax_draft)
    return _acceptance_figure(draws, _labels(len(draws.p)) if labels is None else labels)


def convergence_figure(p, q, ns: Sequence[int] = (100, 1_000, 100_000), seed: int = 0, argmax_draft: bool = False,
                       labels=None):
    """The emitted histogram after n = ns[0], ns[1], ... draws: the noise fades and what is left is p."""
    fig, axes = _figure(len(ns), width=3.9 * len(ns), height=3.4, sharey=True)
    for i, (n, ax) in enumerate(zip(ns, axes)):
        draws = speculative_draws(p, q, n, seed + i, argmax_draft)
        emitted_histogram(draws, ax=ax, labels=_labels(len(draws.p)) if labels is None else labels)
        ax.set_title(f"n = {n:,}: TV = {draws.tv:.3f}")
        if i:
            ax.set_ylabel("")
            ax.get_legend().remove()
    return fig


def shaped_distribution(V: int, peak: int, spread: float) -> torch.Tensor:
    """A toy distribution over V outcomes, highest at `peak` and falling off on both sides:
    softmax(−|i − peak| / spread). A larger spread is a flatter distribution (a higher temperature)."""
    if not 0 <= peak < V:
        raise ValueError(f"peak must lie in [0, {V}), got {peak}")
    if not spread > 0:
        raise ValueError(f"spread must be > 0, got {spread}")
    i = torch.arange(V, dtype=torch.float64)
    return torch.softmax(-(i - peak).abs() / spread, dim=0)


N_CHOICES = (10, 30, 100, 300, 1_000, 3_000, 10_000, 30_000, 100_000)


class AcceptanceExplorer:
    """Sliders that shape a target p and a draft q over V toy tokens; the picture redraws on release.

    Left: p, q and their overlap, whose total 1 − TV(p, q) is the chance a sampled draft is accepted.
    Right: the tokens that n one-draft speculative steps emitted, against p. Switch the draft to
    "argmax of q" (a deterministic drafter, one-hot q): the acceptance becomes p(argmax q), the
    histogram still converges to p. Drag n up to watch it converge; "draw again" reseeds.

    `controls` holds the widgets by name (p_peak, p_spread, q_peak, q_spread, draft, n); setting a
    control's `.value` redraws, as dragging it does. `draws` and `figure` are the latest result.
    """

    def __init__(self, V: int = 6, n: int = 1000, seed: int = 0, labels=None):
        import ipywidgets as w

        if not 2 <= V <= 64:
            raise ValueError(f"V must lie in [2, 64] for a readable picture, got {V}")
        if n not in N_CHOICES:
            raise ValueError(f"n must be one of {N_CHOICES}, got {n}")
        self.V, self.seed = V, seed
        self.labels = _labels(V) if labels is None else list(labels)
        style = {"description_width": "52px"}
        # ipywidgets' default slider (300 px) is wider than a third of a JupyterLab notebook at 1400 px: its
        # readout would sit under the next column ("0.80" read "0.8(").
        narrow = w.Layout(width="260px")

        def peak(value, name):
            return w.IntSlider(value=value, min=0, max=V - 1, description=name, continuous_update=False, style=style,
                               layout=narrow)

        def spread(value, name):
            return w.FloatSlider(value=value, min=0.2, max=3.0, step=0.1, description=name,
                                 continuous_update=False, style=style, layout=narrow)

        self.controls = {
            "p_peak": peak(min(1, V - 1), "peak"), "p_spread": spread(0.8, "spread"),
            "q_peak": peak(min(2, V - 1), "peak"), "q_spread": spread(1.6, "spread"),
            "draft": w.ToggleButtons(options=["sampled from q", "argmax of q"], description="draft",
                                     style={"description_width": "52px", "button_width": "130px"}),
            "n": w.SelectionSlider(options=list(N_CHOICES), value=n, description="draws n", continuous_update=False,
                                   style=style),
        }
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        self.again = w.Button(description="draw again", icon="refresh", layout=w.Layout(width="120px"))
        self.again.on_click(self._draw_again)

        c = self.controls
        column = w.Layout(margin="0 18px 0 0")
        panel = w.HBox([
            w.VBox([w.HTML("<b>target p</b>"), c["p_peak"], c["p_spread"]], layout=column),
            w.VBox([w.HTML("<b>draft q</b>"), c["q_peak"], c["q_spread"]], layout=column),
            w.VBox([w.HTML("<b>speculative sampling</b>"), c["draft"], w.HBox([c["n"], self.again])]),
        ])
        self.image = w.Image(format="png", layout=w.Layout(max_width="1040px"))
        self.readout = w.HTML()
        self.widget = w.VBox([panel, self.image, self.readout])
        self.draws: Draws | None = None
        self.figure = None
        self.update()

    @property
    def p(self) -> torch.Tensor:
        return shaped_distribution(self.V, self.controls["p_peak"].value, self.controls["p_spread"].value)

    @property
    def q(self) -> torch.Tensor:
        """The draft model's distribution (before any argmax)."""
        return shaped_distribution(self.V, self.controls["q_peak"].value, self.controls["q_spread"].value)

    @property
    def argmax_draft(self) -> bool:
        return self.controls["draft"].value == "argmax of q"

    def update(self) -> None:
        """Draw n steps for the current sliders and redraw the picture and the numbers."""
        self.draws = speculative_draws(self.p, self.q, self.controls["n"].value, self.seed, self.argmax_draft)
        self.figure = _acceptance_figure(self.draws, self.labels)
        self.image.value = _png_bytes(self.figure)
        d = self.draws
        rule = "p(argmax q)" if self.argmax_draft else "Σ min(p, q) = 1 − TV(p, q)"
        self.readout.value = (
            f"<div style='font-size:13px'>acceptance: {rule} = <b>{float(acceptance_probability(d.p, d.q)):.3f}</b>"
            f" predicted, <b>{d.acceptance_rate:.3f}</b> measured · emitted histogram vs p: "
            f"TV = <b>{d.tv:.3f}</b> after {d.n:,} draws</div>")

    def _changed(self, change) -> None:
        self.update()

    def _draw_again(self, button=None) -> None:
        self.seed += 1
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        # A bare `explorer` at the end of a cell shows the widget.
        return self.widget._repr_mimebundle_(**kwargs)


def acceptance_explorer(V: int = 6, n: int = 1000, seed: int = 0, labels=None) -> AcceptanceExplorer:
    """The interactive acceptance lesson (needs ipywidgets and a live kernel); see AcceptanceExplorer."""
    return AcceptanceExplorer(V, n, seed, labels)


# ---------------------------------------------------------------------------------------------
# (c) Verification on a hand-made block


def _word(words, i: int) -> str:
    text = words[i] if words is not None else str(i)
    return html.escape(text.replace("\n", "↵").replace("\t", "→")) or "∅"


def _chip(words, token, status: str) -> str:
    """One token, coloured by its fate as in the token strip."""
    return f"<span style='{token_style(status)}padding:0 4px'>{_word(words, int(token))}</span>"


def verification_table(draft_tokens: torch.Tensor, target_probs: torch.Tensor, result: VerifyResult, words=None,
                       draft_lengths: torch.Tensor | None = None):
    """A `verify` call drawn as one small table per sequence, coloured like the token strip.

    Rows: the drafts x_k (rejected ones struck through), the target's choice argmax p_k at each
    position, and what was emitted: the accepted drafts, then the target's correction (at the first
    rejection) or bonus (after the last draft). draft_tokens [B, K], target_probs [B, K+1, V] as given to
    `verify`; `words[i]` names token i. Returns an IPython HTML object.
    """
    from IPython.display import HTML

    B, K = draft_tokens.shape
    lengths = [K] * B if draft_lengths is None else [int(n) for n in draft_lengths]
    choice = target_probs.argmax(dim=-1)
    cell = "padding:2px 8px;text-align:center;white-space:pre;border-bottom:1px solid rgba(128,128,128,.25)"
    tables = []
    for b in range(B):
        a, K_b = int(result.accepted[b]), lengths[b]
        head = "".join(f"<th style='{cell}'>{'bonus slot' if k == K_b else f'k = {k + 1}'}</th>"
                       for k in range(K_b + 1))
        drafts, target, emitted = [], [], []
        for k in range(K_b + 1):
            drafts.append(_chip(words, draft_tokens[b, k], ACCEPTED if k < a else REJECTED) if k < K_b else "")
            target.append(_word(words, int(choice[b, k])))
            if k < a:
                emitted.append(_chip(words, result.tokens[b, k], ACCEPTED))
            elif k == a:
                kind = BONUS if a == K_b else CORRECTION
                emitted.append(f"{_chip(words, result.tokens[b, k], kind)} <small>{kind}</small>")
            else:
                emitted.append("")
        rows = [("draft x<sub>k</sub>", drafts), ("argmax p<sub>k</sub>", target), ("emitted", emitted)]
        body = "".join(f"<tr><th style='{cell};text-align:right'>{name}</th>"
                       + "".join(f"<td style='{cell}'>{v}</td>" for v in values) + "</tr>" for name, values in rows)
        caption = f"sequence {b}: {a} of {K_b} drafts accepted → {a + 1} tokens from one target forward"
        tables.append(f"<table style='border-collapse:collapse;margin:6px 0;font-family:var(--jp-code-font-family,"
                      f"monospace);font-size:13px'><caption style='caption-side:top;text-align:left;"
                      f"font-family:sans-serif'>{caption}</caption><tr><th></th>{head}</tr>{body}</table>")
    keys = "".join(f"<span style='{token_style(s)}padding:0 4px'>{LABELS[s]}</span>"
                   for s in (ACCEPTED, REJECTED, CORRECTION, BONUS))
    legend = f"<div style='font-size:12px;display:flex;gap:12px;flex-wrap:wrap'>{keys}</div>"
    return HTML(legend + "".join(tables))


# ---------------------------------------------------------------------------------------------
# (e) The temperature lesson, on real models


@dataclass
class TemperatureSweep:
    """Speculative runs of several drafters at several temperatures, on the same prompts and seed."""
    temperatures: list[float]
    prompts: list[torch.Tensor]
    runs: dict[str, list[SpecGeneration]]  # drafter name -> one run per temperature

    @property
    def tau(self) -> dict[str, list[float]]:
        """{drafter: [τ at each temperature]} (the input of `acceptance_vs_temperature`)."""
        return {name: [r.stats.tau for r in runs] for name, runs in self.runs.items()}

    @property
    def first_position(self) -> dict[str, list[float]]:
        """{drafter: [acceptance rate of draft position 1 at each temperature]}."""
        return {name: [float(r.stats.per_position[0]) for r in runs] for name, runs in self.runs.items()}

    def texts(self, name: str, i: int) -> list[torch.Tensor]:
        """Prompt + generated tokens of each sequence of drafter `name`'s run at temperatures[i]."""
        run = self.runs[name][i]
        return [torch.cat([prompt, run.tokens[b, : int(run.lengths[b])]]) for b, prompt in enumerate(self.prompts)]


def temperature_sweep(target, drafters: Mapping[str, object], prompts, temperatures: Sequence[float],
                      max_new_tokens: int = 48, seed: int = 0) -> TemperatureSweep:
    """Run `speculative_generate(target, drafter, prompts, ...)` for every drafter and temperature, each
    with a fresh `torch.Generator` seeded with `seed`. prompts: a list of 1-D token tensors."""
    prompts = [torch.as_tensor(p) for p in prompts]
    runs = {name: [] for name in drafters}
    for T in temperatures:
        for name, drafter in drafters.items():
            g = torch.Generator().manual_seed(seed)
            runs[name].append(speculative_generate(target, drafter, prompts, max_new_tokens, temperature=T,
                                                   generator=g))
    return TemperatureSweep(list(temperatures), prompts, runs)


@dataclass
class Agreement:
    """Mean acceptance probability of one draft token, over `positions` contexts."""
    sampled: float  # drafts sampled from q: E[Σ min(p, q)] = E[1 − TV(p, q)]
    argmax: float  # argmax drafts (one-hot q): E[p(argmax q)]
    positions: int


@torch.no_grad()
def draft_agreement(target, draft_model, texts: Sequence[torch.Tensor], temperature: float,
                    starts: int | Sequence[int] = 0, top_k: int | None = None, top_p: float | None = None) -> Agreement:
    """The acceptance a first draft token should get, predicted from full distributions.

    For every context in `texts` (each a 1-D token tensor; the contexts ending at positions >= `starts[i]`
    of text i, or >= `starts` of every text),
    take the target's p and the draft model's q at `temperature` (after the same top-k / top-p), and
    average Σ min(p, q) (sampled drafts) and p(argmax q) (argmax drafts). One forward per model per text.
    """
    sampled = argmax = 0.0
    positions = 0
    starts = [starts] * len(texts) if isinstance(starts, int) else list(starts)
    if len(starts) != len(texts):
        raise ValueError(f"got {len(texts)} texts but {len(starts)} starts")
    for text, start in zip(texts, starts):
        ids = torch.as_tensor(text)[None]
        p_logits = target(input_ids=ids, use_cache=False).logits[0, start:]
        q_logits = draft_model(input_ids=ids, use_cache=False).logits[0, start:]
        p = smp.sampling_probs(p_logits, temperature, top_k, top_p)
        q = smp.sampling_probs(q_logits, temperature, top_k, top_p)
        sampled += float(acceptance_probability(p, q).sum())
        argmax += float(p.gather(-1, smp.greedy(q_logits)[:, None]).sum())
        positions += len(p)
    if positions == 0:
        raise ValueError(f"no context at or after the start positions {starts} in the given texts")
    return Agreement(sampled / positions, argmax / positions, positions)


def predicted_acceptance(target, draft_model, sweep: TemperatureSweep, name: str) -> dict[str, list[float]]:
    """For each temperature of `sweep`, `draft_agreement` on the text that drafter `name` generated at that
    temperature: the contexts the run itself met, from each prompt's last token on."""
    out = {"sampled drafts: Σ min(p, q)": [], "argmax drafts: p(argmax q)": []}
    starts = [len(p) - 1 for p in sweep.prompts]
    for i, T in enumerate(sweep.temperatures):
        a = draft_agreement(target, draft_model, sweep.texts(name, i), T, starts)
        out["sampled drafts: Σ min(p, q)"].append(a.sampled)
        out["argmax drafts: p(argmax q)"].append(a.argmax)
    return out


def rate_table(temperatures: Sequence[float], columns: Mapping[str, Sequence[float]], digits: int = 3) -> str:
    """A plain-text table: one row per temperature, one column per named list of numbers."""
    names = list(columns)
    widths = [max(len(n), digits + 2) for n in names]
    lines = ["T     " + "  ".join(n.rjust(w) for n, w in zip(names, widths))]
    for i, T in enumerate(temperatures):
        cells = [f"{columns[n][i]:.{digits}f}".rjust(w) if not math.isnan(columns[n][i]) else "–".rjust(w)
                 for n, w in zip(names, widths)]
        lines.append(f"{T:<5g} " + "  ".join(cells))
    return "\n".join(lines)
