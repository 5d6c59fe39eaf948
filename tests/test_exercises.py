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


def _window_mask_with(window_from="query", window_rule="<", padding="rows"):
    """The solution with one mistake in the sliding window or in the padding blocks."""
    def fn(anchors, seq_len, block_size, window=None, valid=None):
        query = torch.arange(len(anchors) * block_size)
        block = query // block_size
        c, a = torch.arange(seq_len)[None, :], anchors[block][:, None]
        context = c < a
        if window is not None and window_from != "ignored":
            distance = (a + query[:, None] % block_size if window_from == "query" else a) - c
            context &= distance < window if window_rule == "<" else distance <= window
        allow = torch.cat([context, block[:, None] == block[None, :]], dim=1)
        if valid is None or padding == "ignored":
            return allow
        if padding == "columns":  # a padding block's rows are hidden from everyone, yet its queries still look
            return allow & torch.cat([torch.ones(seq_len, dtype=torch.bool), valid[block]])[None, :]
        return allow & valid[block][:, None]
    return fn


def test_the_window_and_padding_variants_of_the_mask_pass_as_written():
    assert check("dflash_mask", _window_mask_with()).passed


@pytest.mark.parametrize("fn, phrase", [
    (_window_mask_with(window_from="ignored"), "keeps only rows with p - c < W"),
    (_window_mask_with(window_from="anchor"), "not from the anchor"),
    (_window_mask_with(window_rule="<="), "p - c < W, strictly"),
    (_window_mask_with(padding="ignored"), "padding block (valid[2] is False) and sees block row"),
    (_window_mask_with(padding="columns"), "padding block (valid[1] is False) and sees context row 0"),
    (_mask_with(), "window=5): your function raised TypeError"),
])
def test_window_and_padding_mistakes_are_named(fn, phrase):
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


def _boost_with(shift=1, reverse=False, hard=False, all_slots=False, mask_at=1, tv="overlap", detach=True):
    """A boost_loss as a learner might write it, with one mistake switched on."""
    def fn(teacher, student, loss_mask):
        K, S, _ = student.shape
        t = teacher.detach() if detach else teacher
        logp = torch.log_softmax(t[shift:S - 1 + shift], -1)
        kls, accepts = [], []
        for k in range(1, K + 1):
            counted = loss_mask[mask_at:S - 1 + mask_at].bool()
            if not all_slots:
                counted = counted & (torch.arange(S - 1) >= k - 1)
            logq = torch.log_softmax(student[k - 1, :-1], -1)
            if hard:
                score = -logq.gather(-1, logp.argmax(-1, keepdim=True))[:, 0]
            elif reverse:
                score = (logq.exp() * (logq - logp)).sum(-1)
            else:
                score = (logp.exp() * (logp - logq)).sum(-1)
            kls.append(score[counted].mean())
            overlap = (torch.minimum(logp.exp(), logq.exp()).sum(-1) if tv == "overlap"
                       else (logp.argmax(-1) == logq.argmax(-1)).to(logq.dtype))
            accepts.append(overlap[counted].mean())
        return torch.stack(kls), torch.stack(accepts).detach()
    return fn


def test_the_learner_style_boost_loss_passes():
    assert check("boost_loss", _boost_with()).passed


@pytest.mark.parametrize("fn, phrase", [
    (_boost_with(shift=0), "position j, not j+1"),
    (_boost_with(reverse=True), "wrong way round"),
    (_boost_with(hard=True), "hard label"),
    (_boost_with(all_slots=True), "slots j < k-1"),
    (_boost_with(mask_at=0), "loss mask"),
    (_boost_with(tv="argmax"), "argmax agreement"),
    (_boost_with(detach=False), "gradient reaches `teacher`"),
    (lambda t, s, m: tuple(x.detach() for x in _boost_with()(t, s, m)), "carries no gradient"),
])
def test_boost_loss_mistakes_are_named(fn, phrase):
    result = check("boost_loss", fn)
    assert not result.passed and phrase in result.message, result.message


def test_the_drafting_loop_is_not_a_boost_loss():
    # 03x's first exercise checks the recursion's wiring only; this one must reject anything that is not the loss
    result = check("boost_loss", lambda t, s, m: (s.mean((1, 2)), s.mean((1, 2))))
    assert not result.passed and "expected" in result.message


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


def _qad_kl_with(reverse=False, masked=True, t_squared=False, vocab_mean=False, scale_teacher=True,
                 scale_student=True, detach=False):
    """A qad_kl with one mistake switched on."""
    def fn(t, s, mask, temperature):
        t = t / temperature if scale_teacher else t
        s = (s.detach() if detach else s) / (temperature if scale_student else 1.0)
        a, b = (s, t) if reverse else (t, s)
        log_a, log_b = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        terms = log_a.exp() * (log_a - log_b)
        kl = terms.mean(-1) if vocab_mean else terms.sum(-1)
        loss = (kl * mask).sum() / mask.sum() if masked else kl.mean()
        return loss * temperature ** 2 if t_squared else loss
    return fn


@pytest.mark.parametrize("fn, phrase", [
    (_qad_kl_with(reverse=True), "reverse KL"),
    (_qad_kl_with(masked=False), "padded positions"),
    (_qad_kl_with(t_squared=True), "T²"),
    (_qad_kl_with(vocab_mean=True), "sum over V"),
    (_qad_kl_with(scale_teacher=False, scale_student=False), "temperature is missing"),
    (_qad_kl_with(scale_teacher=False), "divide the teacher's too"),
    (_qad_kl_with(detach=True), "no gradient"),
    (lambda t, s, mask, temperature: torch.nn.functional.kl_div(
        torch.log_softmax(s / temperature, -1), torch.log_softmax(t / temperature, -1), reduction="batchmean",
        log_target=True), "batchmean"),
])
def test_qad_kl_mistakes_are_named(fn, phrase):
    result = check("qad_kl", fn)
    assert not result.passed and phrase in result.message, result.message


def test_qad_kl_is_the_projects_qad_loss():
    """The checked formula is `quant.qad.qad_loss`'s: the same number from a model pair."""
    from minispec.quant.qad import qad_loss

    torch.manual_seed(0)
    teacher, student = torch.nn.Embedding(13, 7), torch.nn.Embedding(13, 7)

    class LM(torch.nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb

        def forward(self, input_ids):
            return type("Out", (), {"logits": self.emb(input_ids)})()

    ids = torch.randint(0, 13, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    want = qad_loss(LM(teacher), LM(student), ids, mask)
    got = solutions.qad_kl(teacher(ids).detach(), student(ids), mask, 1.0)
    assert torch.allclose(got, want)


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


# --- 06x: serving costs ---------------------------------------------------------------------------------

def _seconds_with(mistake):
    from minispec.exercises.serving import _seconds_variant
    return lambda *args: _seconds_variant(*args, mistake=mistake)


@pytest.mark.parametrize("fn, phrase", [
    (_seconds_with("sum"), "the two times are added"),
    (_seconds_with("weights_per_sequence"), "once per sequence"),
    (_seconds_with("kv_once"), "every sequence reads its own KV cache"),
    (_seconds_with("kv_per_token"), "once per new token"),
    (_seconds_with("flops_per_sequence"), "every new token costs flops_per_token"),
    (_seconds_with("min"), "the smaller of the two times"),
    (lambda *args: 1e3 * solutions.forward_seconds(*args), "milliseconds"),
    (lambda *args: str(solutions.forward_seconds(*args)), "a number of seconds"),
])
def test_forward_seconds_mistakes_are_named(fn, phrase):
    result = check("forward_seconds", fn)
    assert not result.passed and phrase in result.message, result.message


def _break_even_with(mistake):
    from minispec.exercises.serving import _break_even_variant
    return lambda *args: _break_even_variant(*args, mistake=mistake)


@pytest.mark.parametrize("fn, phrase", [
    (_break_even_with("last_paying"), "the last batch at which speculation still pays"),
    (_break_even_with("verify_k_tokens"), "num_drafts + 1 tokens per sequence"),
    (_break_even_with("no_draft_cost"), "drafting is free"),
    (_break_even_with("powers_of_two"), "only powers of two"),
    (_break_even_with("max_batch_not_none"), "return None"),
    (lambda cost, tau, k, ratio, max_batch: 64, "the cost model gives 363"),
    (lambda *args: float(solutions.break_even_batch(*args) or 0), "an int) or None"),
])
def test_break_even_mistakes_are_named(fn, phrase):
    result = check("break_even_batch", fn)
    assert not result.passed and phrase in result.message, result.message


def test_the_serving_checkers_agree_with_the_cost_model():
    from minispec import costs
    from minispec.exercises import serving

    # The checker's served model holds exactly seq_bytes per sequence, so its answers are the cost model's own.
    model = serving._served(**serving.E4B)
    assert model.kv_bytes(1024) == serving.E4B["seq_bytes"] == costs.E4B_TARGET.kv_bytes(2048)
    assert serving._reference_seconds(64, 8, *serving.E4B.values(), *serving.H200.values()) == (
        costs.forward_seconds(costs.E4B_TARGET, costs.H200, 64, 8, 2048))
    answers = [serving._reference_break_even(m, g, t, k, r, b) for m, g, t, k, r, b, _ in serving._BREAK_EVEN_CASES]
    assert answers == [363, 3217, 1, None]


def _replay_store(flush="overflow", commit="n", fold="committed", write_every_commit=False):
    """replay_cycles as a learner might write it (the solution's replay_verify for the outputs), with one
    mistake in commit or flush switched on."""
    def fn(checkpoint, cycles, A, D, capacity):
        xs, dts, Bs, count, out = [], [], [], 0, []

        def fold_into(ck, m):
            for i in range(m):
                ck = torch.exp(dts[i] * A)[:, None, None] * ck + (dts[i][:, None] * xs[i])[:, :, None] * Bs[i]
            return ck

        for x, dt, B, C, n in cycles:
            T = len(x)
            if (count + T > capacity) if flush == "overflow" else (count + T >= capacity):
                checkpoint = fold_into(checkpoint, count if fold == "committed" else len(xs))
                xs, dts, Bs, count = [], [], [], 0
            xs, dts, Bs = xs[:count] + list(x), dts[:count] + list(dt), Bs[:count] + list(B)
            y = solutions.replay_verify(checkpoint, torch.stack(xs), torch.stack(dts), torch.stack(Bs), C, A, D,
                                        count)
            count += n if commit == "n" else T
            if write_every_commit:
                checkpoint = fold_into(checkpoint, count)
                xs, dts, Bs, count = [], [], [], 0
            out.append((y, checkpoint))
        return out
    return fn


def _plain_recurrence(checkpoint, cycles, A, D, capacity):
    """One running state through every token of every window: the outputs of a plain Mamba decode."""
    S, out = checkpoint.clone(), []
    for x, dt, B, C, _ in cycles:
        ys = []
        for i in range(len(x)):
            S = torch.exp(dt[i] * A)[:, None, None] * S + (dt[i][:, None] * x[i])[:, :, None] * B[i]
            ys.append(S @ C[i] + D[:, None] * x[i])
        out.append((torch.stack(ys), S))
    return out


def test_the_learner_style_store_passes():
    assert check("replay_cycles", _replay_store()).passed


@pytest.mark.parametrize("fn, phrase", [
    (_plain_recurrence, "one state runs through every window token"),
    (_replay_store(write_every_commit=True), "rewritten at every commit"),
    (_replay_store(commit="T"), "commit keeps the whole window"),
    (_replay_store(fold="ring"), "rejected ones too"),
    (_replay_store(flush="fits"), "one window early"),
    (lambda *args: [(y, ck + 1e-3) for y, ck in solutions.replay_cycles(*args)], "checkpoint after cycle 0"),
])
def test_commit_and_flush_mistakes_are_named(fn, phrase):
    result = check("replay_cycles", fn)
    assert not result.passed and phrase in result.message, result.message


# --- the exercise notebooks ------------------------------------------------------------------------------

EXERCISE_NOTEBOOKS = sorted((ROOT / "notebooks").glob("0[1-6]x_exercises_*.ipynb"))


def test_there_is_an_exercise_notebook_beside_each_lesson():
    assert [p.name[:3] for p in EXERCISE_NOTEBOOKS] == ["01x", "02x", "03x", "04x", "05x", "06x"]


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
