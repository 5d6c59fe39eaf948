"""The exercise checkers: every teacher's solution passes, typical wrong answers fail with a message that
names the mistake, misuse raises, and the exercise notebooks pass every check once the solutions are in."""
import json
from pathlib import Path

import pytest
import torch

from minispec.exercises import CHECKERS, CheckResult, check, solutions

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(CHECKERS))
def test_the_solution_passes(name):
    result = check(name, getattr(solutions, name))
    assert result.passed, result.message
    assert result.status == "passed" and "passed" in result._repr_html_()


def test_a_blank_is_not_done_yet_and_an_error_is_a_failure():
    def blank(*args):
        raise NotImplementedError

    def broken(*args):
        return 1 / 0

    result = check("dflash_mask", blank)
    assert (result.passed, result.done, result.status) == (False, False, "not done yet")
    result = check("dflash_mask", broken)
    assert not result.passed and result.done and "ZeroDivisionError" in result.message


def test_misuse_raises():
    with pytest.raises(ValueError, match="verify_step"):
        check("verify", solutions.verify_step)
    with pytest.raises(TypeError, match="function"):
        check("verify_step", None)


# --- 01x: verification -----------------------------------------------------------------------------------

def _residual(p, q):
    r = (p - q).clamp(min=0)
    return r / r.sum()


def make_verify(accept="ratio", correction="residual", bonus=True, bonus_row=-1, stop=True, use_generator=True):
    """A verify_step with one mistake switched on."""
    def fn(drafts, p, q, generator):
        g = generator if use_generator else None
        out = []
        for k, x in enumerate(drafts.tolist()):
            u = torch.rand((), generator=g)
            ok = {"ratio": u < p[k, x] / q[k, x], "deterministic": p[k, x] >= q[k, x], "p": u < p[k, x]}[accept]
            if ok:
                out.append(x)
                continue
            dist = {"residual": _residual(p[k], q[k]), "p": p[k], "q-p": _residual(q[k], p[k])}[correction]
            out.append(int(torch.multinomial(dist, 1, generator=g)))
            if stop:
                return out
        if bonus and len(out) == len(drafts):
            out.append(int(torch.multinomial(p[bonus_row], 1, generator=g)))
        return out
    return fn


VERIFY_MISTAKES = {
    "correction from p": (make_verify(correction="p"), "correction token is drawn from p"),
    "residual q - p": (make_verify(correction="q-p"), "max(q - p, 0)"),
    "deterministic acceptance": (make_verify(accept="deterministic"), "deterministic"),
    "continuing after a rejection": (make_verify(stop=False), "continue"),
    "no bonus token": (make_verify(bonus=False), "no bonus token"),
    "bonus from p[K-1]": (make_verify(bonus_row=-2), "p[K]"),
    "accept with probability p": (make_verify(accept="p"), "min(1, p/q) = 1"),
    "global random numbers": (make_verify(use_generator=False), "generator"),
}


@pytest.mark.parametrize("mistake", list(VERIFY_MISTAKES))
def test_verify_mistakes_are_named(mistake):
    fn, phrase = VERIFY_MISTAKES[mistake]
    result = check("verify_step", fn)
    assert not result.passed and result.done
    assert phrase in result.message, result.message


def test_verify_returns_must_be_a_prefix_then_one_token():
    def reversed_order(drafts, p, q, generator):
        return solutions.verify_step(drafts, p, q, generator)[::-1]

    result = check("verify_step", reversed_order)
    assert not result.passed and "prefix" in result.message


def test_the_exact_outcome_distribution_is_p():
    # Sum over drafts x ~ q of P(outcome | x): the first emitted token is distributed as p[0].
    from minispec.exercises.verify import SAMPLED_P, SAMPLED_Q, outcome_probs

    first = torch.zeros(SAMPLED_P.shape[1], dtype=torch.float64)
    for x0 in range(4):
        for x1 in range(4):
            probs = outcome_probs(torch.tensor([x0, x1]), SAMPLED_P, SAMPLED_Q)
            weight = SAMPLED_Q[0, x0].double() * SAMPLED_Q[1, x1].double()
            first += weight * probs[0]
            first[x0] += weight * probs[1:].sum()
    assert torch.allclose(first, SAMPLED_P[0].double(), atol=1e-12)


# --- 02x: the DFlash mask --------------------------------------------------------------------------------

def _mask_with(context_rule="<", causal_block=False, all_blocks=False):
    def fn(anchors, seq_len, block_size):
        block = torch.arange(len(anchors) * block_size) // block_size
        c, a = torch.arange(seq_len)[None, :], anchors[block][:, None]
        context = {"<": c < a, "<=": c <= a, "all": torch.ones_like(c < a)}[context_rule]
        own = block[:, None] == block[None, :]
        if all_blocks:
            own = torch.ones_like(own)
        if causal_block:
            q = torch.arange(len(block))
            own = own & (q[None, :] <= q[:, None])
        return torch.cat([context, own], dim=1)
    return fn


@pytest.mark.parametrize("fn, phrase", [
    (_mask_with(context_rule="<="), "the anchor itself"),
    (_mask_with(context_rule="all"), "the future"),
    (_mask_with(causal_block=True), "bidirectional"),
    (_mask_with(all_blocks=True), "never see each"),
    (lambda a, s, t: _mask_with()(a, s, t).T, "shape"),
    (lambda a, s, t: _mask_with()(a, s, t).float(), "bool"),
])
def test_mask_mistakes_are_named(fn, phrase):
    result = check("dflash_mask", fn)
    assert not result.passed and phrase in result.message, result.message


# --- 03x: MTP drafting -----------------------------------------------------------------------------------

def _mtp_with(keep_hidden=False, keep_token=False, logits_of_input=False, extra=0):
    def fn(head, embed, lm_head, hidden, token, K):
        drafts, h, t = [], hidden, token
        for _ in range(K + extra):
            out = head(h, embed(t))
            d = int(lm_head(h if logits_of_input else out).argmax())
            drafts.append(d)
            h = h if keep_hidden else out
            t = t if keep_token else d
        return drafts
    return fn


@pytest.mark.parametrize("fn, phrase", [
    (_mtp_with(keep_hidden=True), "backbone's hidden state again"),
    (_mtp_with(keep_token=True), "original `token`"),
    (_mtp_with(logits_of_input=True), "lm_head(out)"),
    (_mtp_with(extra=1), "one draft per depth"),
])
def test_mtp_mistakes_are_named(fn, phrase):
    result = check("mtp_draft", fn)
    assert not result.passed and phrase in result.message, result.message


# --- 04x: E2M1 and NVFP4 scales --------------------------------------------------------------------------

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1_with(ties="even", saturate=True, keep_sign=True):
    def fn(x):
        a = x.abs().clamp(max=6.0) if saturate else x.abs()
        step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
        n = a / step
        r = torch.round(n) if ties == "even" else torch.floor(n + 0.5)
        return torch.copysign(r * step, x) if keep_sign else r * step
    return fn


@pytest.mark.parametrize("fn, phrase", [
    (_e2m1_with(ties="away"), "even mantissa"),
    (_e2m1_with(saturate=False), "saturates"),
    (_e2m1_with(keep_sign=False), "sign is lost"),
    (lambda x: GRID[(x.abs()[:, None] - GRID).abs().argmin(1)] * x.sign(), "even mantissa"),
])
def test_e2m1_mistakes_are_named(fn, phrase):
    result = check("e2m1_round", fn)
    assert not result.passed and phrase in result.message, result.message


def _scales_with(g_div=6 * 448, floor_g=True, floor_s=True, rounded=True, divide_by_g=True):
    def fn(x):
        g = x.abs().max() / g_div
        if floor_g:
            g = g.clamp(min=2.0**-126)
        s = x.reshape(x.shape[0], -1, 16).abs().amax(-1) / (6 * g if divide_by_g else 6)
        s = s.clamp(min=2.0**-9 if floor_s else 0.0, max=448.0)
        return g, s.to(torch.float8_e4m3fn).float() if rounded else s
    return fn


@pytest.mark.parametrize("fn, phrase", [
    (_scales_with(g_div=6), "amax / 6"),
    (_scales_with(rounded=False), "not rounded to E4M3"),
    (_scales_with(divide_by_g=False), "divide by the global scale"),
    (_scales_with(floor_s=False), "all-zero block"),
    (_scales_with(floor_g=False), "2**-126"),
])
def test_nvfp4_scale_mistakes_are_named(fn, phrase):
    result = check("nvfp4_scales", fn)
    assert not result.passed and phrase in result.message, result.message


# --- 05x: replay -----------------------------------------------------------------------------------------

def _replay_with(**mistake):
    from minispec.exercises.replay import _variant
    return lambda *args: _variant(*args, **mistake)


@pytest.mark.parametrize("fn, phrase", [
    (_replay_with(skip=True), "skip term"),
    (_replay_with(decay_after=True), "decayed by its own step"),
    (_replay_with(window_only=True), "committed records"),
    (_replay_with(no_dt=True), "dt is missing"),
    (lambda *args: solutions.replay_verify(*args)[-1:].expand(args[4].shape[0], -1, -1), "causal"),
])
def test_replay_mistakes_are_named(fn, phrase):
    result = check("replay_verify", fn)
    assert not result.passed and phrase in result.message, result.message


# --- the exercise notebooks ------------------------------------------------------------------------------

EXERCISE_NOTEBOOKS = sorted((ROOT / "notebooks").glob("0[1-5]x_exercises_*.ipynb"))


def test_there_is_an_exercise_notebook_beside_each_lesson():
    assert [p.name[:3] for p in EXERCISE_NOTEBOOKS] == ["01x", "02x", "03x", "04x", "05x"]


def _with_solutions(path: Path):
    """The notebook with each cell tagged "exercise" replaced by an import of the teacher's solution."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    names = []
    for cell in nb.cells:
        if "exercise" in cell.metadata.get("tags", []):
            name = cell.source.split("def ", 1)[1].split("(", 1)[0]
            names.append(name)
            cell.source = f"from minispec.exercises.solutions import {name}"
    return nb, names


@pytest.mark.slow
@pytest.mark.parametrize("path", EXERCISE_NOTEBOOKS, ids=lambda p: p.name)
def test_every_check_passes_with_the_solutions_filled_in(path):
    from nbclient import NotebookClient

    nb, names = _with_solutions(path)
    assert names, f"{path.name} has no cell tagged 'exercise'"
    NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    reports = [o.get("data", {}).get("text/plain", "") for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []) if o.get("output_type") == "execute_result"]
    checked = [r for r in reports if any(f"{n}: " in r for n in names)]
    assert len(checked) == len(names), reports
    assert all(": passed" in r for r in checked), checked


@pytest.mark.parametrize("path", EXERCISE_NOTEBOOKS, ids=lambda p: p.name)
def test_exercise_notebooks_do_not_print_the_solutions(path):
    source = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    assert "solutions" not in source
    for name in CHECKERS:
        if f"def {name}(" in source:
            body = source.split(f"def {name}(", 1)[1].split("check(", 1)[0]
            assert "raise NotImplementedError" in body


def test_result_shows_in_a_notebook():
    html = CheckResult("verify_step", False, "a <b> message").__repr__()
    assert "failed" in html and "<b>" in html
    assert "&lt;b&gt;" in CheckResult("verify_step", False, "a <b> message")._repr_html_()
