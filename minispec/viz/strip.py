"""Token strips: watch speculative decoding keep and throw away drafts, one verification at a time.

Each cycle's tokens are coloured by what happened to them:

    accepted    a draft the target agreed with: it is in the output
    rejected    a draft the target turned down (struck through): it never reaches the output
    correction  the target's own token at the first rejection
    bonus       the target's extra token when every draft was accepted

and a thin bar separates cycles, so a run of long cycles (high τ) reads as long segments.

    strip = TokenStrip(tok)          # notebook: a widget that grows while generation runs
    strip.prompt(prompt_ids[-60:])
    strip.display()
    speculative_generate(..., on_cycle=strip)

    speculative_generate(..., on_cycle=AnsiStrip(tok))   # terminal: prints as cycles arrive
"""
from __future__ import annotations

import html
import io
import sys

from minispec.speculative.stats import ACCEPTED, BONUS, CORRECTION, REJECTED, CycleRecord, SpecStats, Token

STATUSES = (ACCEPTED, REJECTED, CORRECTION, BONUS)
LABELS = {ACCEPTED: "accepted draft", REJECTED: "rejected draft", CORRECTION: "target correction",
          BONUS: "bonus (all accepted)"}

# Okabe–Ito colours: told apart with the common colour-vision deficiencies. Only the background is
# tinted (translucent), the text keeps the theme's colour, so the strip reads on light and dark themes.
COLORS = {ACCEPTED: "#009E73", REJECTED: "#D55E00", CORRECTION: "#E69F00", BONUS: "#0072B2"}
PROMPT_COLOR = "#888888"


# ---------------------------------------------------------------------------------------------
# Shared by both renderers


def shown_tokens(record: CycleRecord) -> list[Token]:
    """The tokens of one cycle to draw, in order. The loop cuts a cycle at EOS or max_new_tokens
    (`record.emitted` is then shorter than accepted + 1): tokens past the cut never happened, so the
    strip stops there, and the strip's kept tokens are exactly the output."""
    shown, left = [], len(record.emitted)
    for token in record.tokens:
        if left == 0:
            break
        shown.append(token)
        left -= token.status != REJECTED
    return shown


def visible_whitespace(text: str, kept: bool, mark) -> str:
    """Mark tabs and newlines with `mark("→")` / `mark("↵")`. A kept token still breaks the line after
    its ↵, so the strip is laid out like the output; a rejected draft never reached the output, so its
    newline stays a mark and the strip does not jump a line for it."""
    for char, symbol in (("\t", "→"), ("\n", "↵")):
        text = text.replace(char, mark(symbol) + (char if kept else ""))
    return text


def describe(text: str, token: Token, cycle: int) -> str:
    """What a hover shows: the exact text, its fate, its cycle, and p / q where known."""
    parts = [repr(text), token.status, f"cycle {cycle}"]
    parts += [f"{name} {value:.3f}" for name, value in (("p", token.p), ("q", token.q)) if value is not None]
    return " · ".join(parts)


def summary(records: list[CycleRecord]) -> str:
    """Verification cycles (the prefill's record, cycle 0, is not one), τ and tokens emitted."""
    stats = SpecStats(records)
    n = len(stats.verifications)
    tau = f"{stats.tau:.2f}" if n else "–"
    tokens = sum(len(r.emitted) for r in records)
    return f"cycles {n} · τ {tau} · tokens {tokens}"


def _ids(ids) -> list[int]:
    """A tensor or a list of token ids as a list of ints (tokenizers want plain ints)."""
    return [int(i) for i in ids]


# ---------------------------------------------------------------------------------------------
# HTML, for notebooks

CYCLE_BAR = ('<span class="ms-cycle" style="border-left:2px solid rgba(128,128,128,.55);'
             'margin:0 2px"></span>')
STRIP_STYLE = ("font-family:var(--jp-code-font-family,monospace);font-size:13px;line-height:1.7;"
               "white-space:pre-wrap;overflow-wrap:anywhere;tab-size:4;padding:4px 0")
FAINT = '<span style="opacity:.45">{}</span>'


def token_style(status: str) -> str:
    """Colour carries the category, and a second cue does too, for readers who can't tell the
    colours apart: rejected drafts are struck through, the target's own tokens underlined. Shadows,
    not borders or margins, draw the edges: they take no room, so columns stay where the code has them."""
    color = COLORS[status]
    edges = ["inset -1px 0 rgba(128,128,128,.35)"]  # a hairline after each token: where tokens split
    style = f"background:{color}40;border-radius:3px;"
    if status == REJECTED:
        style += f"text-decoration:line-through;text-decoration-color:{color};opacity:.8;"
    if status in (CORRECTION, BONUS):
        edges.append(f"inset 0 -2px {color}")
    return style + f"box-shadow:{','.join(edges)};"


def html_token(text: str, token: Token, cycle: int) -> str:
    shown = html.escape(text) or FAINT.format("∅")  # an empty decode would be an invisible span
    shown = visible_whitespace(shown, token.status != REJECTED, FAINT.format)
    title = html.escape(describe(text, token, cycle), quote=True)
    style = token_style(token.status)
    return f'<span class="ms-tok ms-{token.status}" style="{style}" title="{title}">{shown}</span>'


def html_cycle(record: CycleRecord, tokenizer) -> str:
    return "".join(html_token(tokenizer.decode([t.id]), t, record.cycle) for t in shown_tokens(record))


def html_legend() -> str:
    keys = [f'<span class="ms-key" style="{token_style(s)}padding:0 4px">{LABELS[s]}</span>' for s in STATUSES]
    keys.append(f"<span>{CYCLE_BAR}cycle boundary</span>")
    return f'<div style="font-size:12px;display:flex;gap:12px;flex-wrap:wrap">{"".join(keys)}</div>'


class TokenStrip:
    """A live, coloured token strip for one sequence of a (batched) speculative generation.

    Use it as the `on_cycle` callback. `display()` shows it as a widget that re-renders after every
    cycle; `html()` is the same picture as a string, and a bare `strip` in a cell shows a snapshot.
    """

    def __init__(self, tokenizer, sequence: int = 0):
        self.tokenizer = tokenizer
        self.sequence = sequence
        self.records: list[CycleRecord] = []
        self._prompt = ""
        self._cycles: list[str] = []  # each cycle's HTML, rendered once as it arrives
        self._widget = None

    def update(self, record: CycleRecord) -> None:
        if record.sequence != self.sequence:
            return
        self.records.append(record)
        self._cycles.append(html_cycle(record, self.tokenizer))
        self._refresh()

    __call__ = update

    def prompt(self, ids) -> None:
        """Show the prompt (or its tail: pass `ids[-n:]`) in grey before the generated tokens. Decoded in
        one piece, so characters split across tokens come out whole."""
        ids = _ids(ids)
        title = html.escape(f"prompt, {len(ids)} tokens", quote=True)
        text = visible_whitespace(html.escape(self.tokenizer.decode(ids)), True, FAINT.format)
        self._prompt = f'<span class="ms-prompt" style="color:{PROMPT_COLOR}" title="{title}">{text}</span>'
        self._refresh()

    def summary(self) -> str:
        return summary(self.records)

    def body_html(self) -> str:
        parts = ([self._prompt] if self._prompt else []) + self._cycles
        return f'<div class="ms-strip" style="{STRIP_STYLE}">{CYCLE_BAR.join(parts)}</div>'

    def html(self) -> str:
        """Legend, strip and summary line, as one HTML string."""
        return f"<div>{html_legend()}{self.body_html()}{self._summary_html()}</div>"

    def _repr_html_(self) -> str:
        return self.html()

    def _summary_html(self) -> str:
        # Named as this one sequence's numbers: a notebook often prints the whole batch's τ right below.
        return (f'<div class="ms-summary" style="font-size:12px;opacity:.8">this strip (sequence {self.sequence} of '
                f'the batch): {self.summary()}</div>')

    @property
    def widget(self):
        """The ipywidgets view, made on first use (the terminal and tests never need ipywidgets)."""
        if self._widget is None:
            import ipywidgets

            parts = (html_legend(), self.body_html(), self._summary_html())
            self._widget = ipywidgets.VBox([ipywidgets.HTML(p) for p in parts])
        return self._widget

    def display(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _refresh(self) -> None:
        if self._widget is not None:
            _, body, line = self._widget.children
            body.value, line.value = self.body_html(), self._summary_html()


# ---------------------------------------------------------------------------------------------
# ANSI, for the terminal

RESET, DIM, NORMAL_INTENSITY = "\x1b[0m", "\x1b[2m", "\x1b[22m"
SGR = {ACCEPTED: "\x1b[32m", REJECTED: "\x1b[31m\x1b[9m", CORRECTION: "\x1b[33m", BONUS: "\x1b[34m"}
# Without colour (a log file, a pipe), brackets carry the category; kept drafts stay bare so the
# output text still reads.
MARKERS = {ACCEPTED: ("", ""), REJECTED: ("[-", "-]"), CORRECTION: ("[*", "*]"), BONUS: ("[+", "+]")}


def _dim(symbol: str) -> str:
    # Normal intensity (22), not a full reset, so the token's own colour carries on after the mark.
    return f"{DIM}{symbol}{NORMAL_INTENSITY}"


def ansi_token(text: str, status: str, color: bool) -> str:
    kept = status != REJECTED
    if not color:
        opening, closing = MARKERS[status]
        return f"{opening}{visible_whitespace(text, kept, str)}{closing}"
    return f"{SGR[status]}{visible_whitespace(text, kept, _dim)}{RESET}"


def ansi_bar(color: bool) -> str:
    return f"{DIM}│{RESET}" if color else "|"


def ansi_legend(color: bool = True) -> str:
    keys = [ansi_token(LABELS[s], s, color) for s in STATUSES]
    return "  ".join(keys + [f"{ansi_bar(color)} cycle boundary"])


class AnsiStrip:
    """The token strip for a terminal: use it as `on_cycle`; each cycle is printed as it arrives.

    `color=None` colours only when `stream` is a terminal, so redirected output gets bracket markers.
    """

    def __init__(self, tokenizer, stream=None, sequence: int = 0, color: bool | None = None):
        self.tokenizer = tokenizer
        self.stream = sys.stdout if stream is None else stream  # looked up now: tests swap sys.stdout
        self.sequence = sequence
        self.color = self.stream.isatty() if color is None else color
        self.records: list[CycleRecord] = []
        self._started = False

    def update(self, record: CycleRecord) -> None:
        if record.sequence != self.sequence:
            return
        self.records.append(record)
        text = "".join(ansi_token(self.tokenizer.decode([t.id]), t.status, self.color)
                       for t in shown_tokens(record))
        self._write(text)

    __call__ = update

    def prompt(self, ids) -> None:
        text = self.tokenizer.decode(_ids(ids))
        self._write(f"{DIM}{text}{RESET}" if self.color else text)

    def legend(self) -> None:
        self.stream.write(ansi_legend(self.color) + "\n")

    def finish(self) -> None:
        """End the strip's line and print the summary: cycles, τ, tokens."""
        self.stream.write(f"\n{summary(self.records)}\n")
        self.stream.flush()

    def _write(self, text: str) -> None:
        if self._started:
            text = ansi_bar(self.color) + text
        self._started = True
        self.stream.write(text)
        self.stream.flush()  # show each cycle now, not when the buffer fills


def ansi_strip(records: list[CycleRecord], tokenizer, sequence: int = 0, color: bool = True) -> str:
    """The whole strip for `records` as one string (what AnsiStrip would have printed)."""
    out = io.StringIO()
    strip = AnsiStrip(tokenizer, out, sequence, color)
    for record in records:
        strip.update(record)
    return out.getvalue()
