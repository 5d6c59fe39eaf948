"""The token strips (HTML and ANSI) and the acceptance figures, on synthetic cycles and the real tokenizer."""
import io
import re
import subprocess
import sys
from html.parser import HTMLParser

import matplotlib

matplotlib.use("Agg")  # before anything imports pyplot

import pytest
import torch
from transformers import AutoTokenizer

from minispec.speculative.stats import ACCEPTED, BONUS, CORRECTION, REJECTED, CycleRecord, SpecStats, Token
from minispec.targets.load import CHECKPOINTS
from minispec.viz import (
    AnsiStrip,
    LivePlot,
    TokenStrip,
    acceptance_vs_temperature,
    ansi_strip,
    distribution_pair,
    per_position_acceptance,
    tau_histogram,
)

SNIPPET = 'if a < b && x:\n    return "<&>"\n'


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer")


def cycle(n, kept, rejected, last, last_status, sequence=0, emitted=None):
    """One CycleRecord: `kept` accepted drafts, `rejected` drafts, then the target's `last` token."""
    tokens = [Token(i, ACCEPTED, p=0.9, q=0.8) for i in kept]
    tokens += [Token(i, REJECTED, p=0.0125, q=0.75) for i in rejected]
    tokens.append(Token(last, last_status, p=0.5))  # the target's token has no q
    full = [*kept, last]
    return CycleRecord(n, sequence, len(kept) + len(rejected), len(kept), tokens,
                       full if emitted is None else full[:emitted])


@pytest.fixture(scope="module")
def ids(tok):
    ids = tok.encode(SNIPPET)
    assert tok.decode(ids) == SNIPPET
    return ids


@pytest.fixture(scope="module")
def records(ids):
    """cycle 0: 3 accepted, 1 rejected, correction; cycle 1: 4 accepted + bonus;
    cycle 2: 4 rejected (holding '<', '&' and a newline), correction."""
    newline = ids[8]
    return [cycle(0, ids[0:3], [ids[7]], ids[3], CORRECTION),
            cycle(1, ids[4:8], [], ids[8], BONUS),
            cycle(2, [], [ids[2], ids[5], newline, ids[10]], ids[9], CORRECTION)]


class Spans(HTMLParser):
    """Collects (class, title, style, text) of every token span; a stray '<' or '&' in token text
    would break this parse, which is how escaping is checked."""

    def __init__(self, html):
        super().__init__()
        self.spans, self._current, self._depth = [], None, 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if self._depth:  # a whitespace mark inside a token
            self._depth += 1
        elif "ms-tok" in (attrs.get("class") or ""):
            self._current, self._depth = [attrs["class"].split()[1], attrs["title"], attrs["style"], ""], 1

    def handle_endtag(self, tag):
        if self._depth:
            self._depth -= 1
            if not self._depth:
                self.spans.append(tuple(self._current))

    def handle_data(self, data):
        if self._depth:
            self._current[3] += data


def strip_of(tok, records, sequence=0):
    strip = TokenStrip(tok, sequence)
    for r in records:
        strip(r)
    return strip


def test_html_has_one_span_per_token_with_its_status(tok, records):
    spans = Spans(strip_of(tok, records).body_html()).spans
    statuses = [s[0] for s in spans]
    assert statuses.count("ms-accepted") == 7
    assert statuses.count("ms-rejected") == 5
    assert statuses.count("ms-correction") == 2
    assert statuses.count("ms-bonus") == 1
    expected = [t.status for r in records for t in r.tokens]
    assert statuses == ["ms-" + s for s in expected]


def test_html_escapes_token_text_and_marks_whitespace(tok, records):
    html = strip_of(tok, records).body_html()
    assert "&lt;" in html and "&amp;" in html
    spans = Spans(html).spans
    shown = [text for _, _, _, text in spans]
    decoded = [tok.decode([t.id]) for r in records for t in r.tokens]
    # The parser unescapes: the visible text is the token text, with ↵ / → before newlines and tabs,
    # and kept tokens keep their newline while a rejected draft's newline stays a mark only.
    kept = [t.status != REJECTED for r in records for t in r.tokens]
    assert shown == [d.replace("\n", "↵\n" if k else "↵") for d, k in zip(decoded, kept)]
    assert any("<" in s for s in shown) and any("&" in s for s in shown)


def test_rejected_drafts_are_struck_through(tok, records):
    for status, _, style, _ in Spans(strip_of(tok, records).body_html()).spans:
        assert ("line-through" in style) == (status == "ms-rejected")


def test_titles_give_text_status_cycle_p_and_q(tok, records, ids):
    spans = Spans(strip_of(tok, records).body_html()).spans
    first, correction = spans[0], spans[4]
    assert first[1] == f"{tok.decode([ids[0]])!r} · accepted · cycle 0 · p 0.900 · q 0.800"
    assert correction[1] == f"{tok.decode([ids[3]])!r} · correction · cycle 0 · p 0.500"
    assert "p 0.013 · q 0.750" in spans[3][1]


def test_cycle_boundaries_separate_prompt_and_cycles(tok, records, ids):
    strip = strip_of(tok, records)
    assert strip.body_html().count('class="ms-cycle"') == 2
    strip.prompt(torch.tensor(ids[:3]))
    body = strip.body_html()
    assert body.count('class="ms-cycle"') == 3
    assert body.index('class="ms-prompt"') < body.index('class="ms-tok')


def test_token_strip_grows_and_ignores_other_sequences(tok, records, ids):
    strip = TokenStrip(tok)
    counts = []
    for r in records:
        strip(r)
        strip(cycle(r.cycle, ids[:2], [], ids[2], CORRECTION, sequence=1))
        counts.append(len(Spans(strip.body_html()).spans))
    assert counts == [5, 10, 15]
    assert len(strip.records) == 3
    assert strip.summary() == "cycles 3 · τ 3.33 · tokens 10"
    assert "cycles 3 · τ 3.33 · tokens 10" in strip.html() == strip._repr_html_()


def test_widget_follows_the_records(tok, records):
    strip = TokenStrip(tok)
    strip(records[0])
    legend, body, line = strip.widget.children
    strip(records[1])
    assert body.value == strip.body_html() and len(Spans(body.value).spans) == 10
    assert line.value.count("cycles 2") == 1


def test_tokens_past_the_cut_are_not_shown(tok, ids):
    cut = cycle(0, ids[0:3], [ids[7]], ids[3], CORRECTION, emitted=2)  # EOS or max_new_tokens after 2
    assert [s[0] for s in Spans(strip_of(tok, [cut]).body_html()).spans] == ["ms-accepted"] * 2


def test_ansi_colours_in_token_order(tok, records):
    out = ansi_strip(records, tok)
    codes = re.findall(r"\x1b\[(\d+)m", out)
    colours = [c for c in codes if c in {"32", "31", "33", "34", "9"}]
    order = {ACCEPTED: ["32"], REJECTED: ["31", "9"], CORRECTION: ["33"], BONUS: ["34"]}
    assert colours == [c for r in records for t in r.tokens for c in order[t.status]]
    assert out.count("\x1b[2m│\x1b[0m") == 2
    assert "\x1b[31m\x1b[9m" + tok.decode([records[0].tokens[3].id]) + "\x1b[0m" in out


def test_ansi_without_colour_uses_markers(tok, records):
    def d(i):
        return tok.decode([i])
    r0 = records[0]
    expected = "".join(d(i) for i in r0.emitted[:3]) + f"[-{d(r0.tokens[3].id)}-][*{d(r0.emitted[3])}*]"
    out = ansi_strip(records, tok, color=False)
    assert out.startswith(expected + "|")
    assert out.count("|") == 2 and "\x1b" not in out
    assert "[+↵\n   +]" in out and "[-↵   -]" in out  # a kept newline breaks the line, a rejected one not


def test_ansi_strip_prints_each_cycle_as_it_arrives(tok, records, ids):
    stream = io.StringIO()
    strip = AnsiStrip(tok, stream)  # a StringIO is no terminal: no colour
    strip.prompt(ids[:2])
    lengths = []
    for r in records:
        strip(r)
        strip(cycle(r.cycle, ids[:2], [], ids[2], CORRECTION, sequence=1))
        lengths.append(len(stream.getvalue()))
    assert lengths[0] < lengths[1] < lengths[2]
    strip.finish()
    assert stream.getvalue().endswith("\ncycles 3 · τ 3.33 · tokens 10\n")
    assert stream.getvalue().startswith(tok.decode(ids[:2]) + "|")


def test_tau_histogram_bars_and_line(records):
    stats = SpecStats(list(records))
    fig = tau_histogram(stats)
    ax = fig.axes[0]
    heights = [bar.get_height() for bar in ax.containers[0]]
    assert heights == stats.histogram[1:].tolist()
    assert list(ax.lines[0].get_xdata()) == pytest.approx([stats.tau] * 2)
    assert f"τ = {stats.tau:.2f}" in ax.get_title()
    assert tau_histogram(stats.histogram.tolist()).axes[0].lines[0].get_xdata()[0] == pytest.approx(stats.tau)


def test_per_position_curves(records):
    stats = SpecStats(list(records))
    fig = per_position_acceptance({"stale head": [0.9, 0.5, 0.25], "boosted": torch.tensor([0.95, 0.7, 0.5]),
                                   "measured": stats})
    lines = fig.axes[0].lines
    assert [line.get_label() for line in lines] == ["stale head", "boosted", "measured"]
    assert list(lines[0].get_xdata()) == [1, 2, 3]
    assert list(lines[1].get_ydata()) == pytest.approx([0.95, 0.7, 0.5])
    assert list(lines[2].get_ydata()) == pytest.approx(stats.per_position.tolist())
    assert fig.axes[0].get_ylim() == pytest.approx((0, 1.02))
    assert fig.axes[0].get_legend() is not None
    assert per_position_acceptance([0.5, 0.4]).axes[0].get_legend() is None


def test_acceptance_vs_temperature():
    fig = acceptance_vs_temperature([0.0, 0.5, 1.0], {"DFlash": [4.1, 3.6, 3.0], "MTP": [2.5, 2.2, 2.0]})
    lines = fig.axes[0].lines
    assert list(lines[0].get_ydata()) == [4.1, 3.6, 3.0]
    assert list(lines[1].get_xdata()) == [0.0, 0.5, 1.0]
    assert fig.axes[0].get_ylim()[0] == 1


def test_distribution_pair_overlap_and_title():
    p, q = torch.tensor([0.5, 0.3, 0.2]), [0.2, 0.3, 0.5]
    ax = distribution_pair(p, q, labels=["a", "b", "c"]).axes[0]
    p_bars, q_bars, overlap = ax.containers
    assert [b.get_height() for b in overlap] == pytest.approx([0.2, 0.3, 0.2])
    assert [b.get_height() for b in p_bars] == pytest.approx(p.tolist())
    assert "1 − TV(p, q) = 0.700" in ax.get_title()
    with pytest.raises(ValueError, match="same length"):
        distribution_pair([0.5, 0.5], [1.0])


def test_plots_draw_into_a_given_axes():
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2)
    assert tau_histogram([0, 1, 2], ax=a) is fig and per_position_acceptance([0.5], ax=b) is fig
    plt.close(fig)


def test_live_plot_records_outside_ipython():
    live = LivePlot("training", "step", "loss", series=["train", "eval"])
    for step in range(3):
        live.add(step, train=1.0 / (step + 1))
    live.add(2, eval=0.4)
    assert live.data == {"train": [(0.0, 1.0), (1.0, 0.5), (2.0, pytest.approx(1 / 3))], "eval": [(2.0, 0.4)]}
    with pytest.raises(ValueError, match="unknown series"):
        live.add(3, tain=0.1)
    lines = live.figure().axes[0].lines
    assert [list(line.get_ydata()) for line in lines] == [pytest.approx([1.0, 0.5, 1 / 3]), [0.4]]
    assert lines[1].get_label() == "eval: 0.4"


def test_importing_viz_does_not_import_matplotlib():
    code = "import sys, minispec.viz; print('matplotlib' in sys.modules, 'ipywidgets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_hsm_study_draws_each_arms_mean_and_standard_error_per_depth():
    from minispec.lessons import mtp_boosting as mtp

    study = {"one_minus_tv": {"boost-hsm": [[0.6, 0.5, 0.4], [0.62, 0.5, 0.44]],
                              "boost-depth1": [[0.6, 0.4, 0.3], [0.6, 0.42, 0.3]]}}
    ax = mtp.hsm_study(study, trained_depths=2).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["3 depths, HSM", "trained at depth 1 only"]
    lines = [c.lines[0] for c in ax.containers]  # ErrorbarContainer: (data line, caps, bars)
    assert [round(y, 6) for y in lines[0].get_ydata()] == [0.61, 0.5, 0.42]
    assert [round(y, 6) for y in lines[1].get_ydata()] == [0.6, 0.41, 0.3]
    low, high = ax.containers[0].lines[1]  # the caps: mean ∓ standard error (std 0.0141 / √2 seeds at depth 1)
    assert round(float(high.get_ydata()[0]), 6) == 0.62 and round(float(low.get_ydata()[0]), 6) == 0.6


def test_al_table_aligns_columns_of_any_width():
    from minispec.lessons import mtp_boosting as mtp

    rows = {"short": {"T=0": {"tau": 2.0, "per_position": [0.5]}},
            "long": {"T=0": {"tau": 3.456, "per_position": [0.9, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4]}}}
    lines = mtp.al_table(rows, modes=("T=0",)).splitlines()
    assert len({len(line) for line in lines}) == 1  # right-aligned to one width
    assert lines[1].endswith("τ 2.00 (0.50)") and lines[2].endswith("τ 3.46 (0.90 0.80 0.75 0.70 0.60 0.50 0.40)")
