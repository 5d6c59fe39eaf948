"""The teaching pieces of notebook 01 (minispec/lessons/speculative_sampling.py): the statistics they show are right,
the widget redraws when a slider moves, and the cost-model curve is the cost model."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before anything imports pyplot

import pytest
import torch
import torch.nn.functional as F

from minispec import costs
from minispec.drafters import DraftLMDrafter, NGramDrafter
from minispec.lessons import speculative_sampling as lessons
from minispec.speculative.autoregressive import autoregressive_generate
from minispec.speculative.sampling import sampling_probs
from minispec.speculative.verify import verify
from tiny import tiny_gemma

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_speculative_sampling.ipynb"

N = 200_000
# 99.9th percentile of the chi-square distribution with 5 degrees of freedom (V = 6 outcomes, all with
# p > 0): a correct sampler fails one parametrised case in a thousand by chance; seeds are fixed anyway.
CHI2_5DOF_999 = 20.515
P = [0.05, 0.40, 0.25, 0.15, 0.10, 0.05]
PAIRS = {
    "overlapping": (P, [0.30, 0.10, 0.25, 0.05, 0.20, 0.10]),
    "draft peaked elsewhere": (P, [0.02, 0.02, 0.02, 0.02, 0.02, 0.90]),
    "draft equals target": (P, P),
}


def chi_square(counts: torch.Tensor, p) -> float:
    expected = counts.sum() * torch.as_tensor(p, dtype=torch.float64)
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("argmax_draft", [False, True], ids=["sampled", "argmax"])
@pytest.mark.parametrize("pair", PAIRS, ids=list(PAIRS))
def test_emitted_tokens_follow_p(pair, argmax_draft):
    p, q = PAIRS[pair]
    draws = lessons.speculative_draws(p, q, N, seed=1, argmax_draft=argmax_draft)
    assert draws.n == N
    # Chi-square goodness of fit against p at the 0.1 % level, and a TV bound: E[TV] ≈ 0.002 at this N.
    assert chi_square(draws.counts, p) < CHI2_5DOF_999
    assert draws.tv < 0.01


@pytest.mark.parametrize("argmax_draft", [False, True], ids=["sampled", "argmax"])
def test_accepted_part_is_min_p_q_and_residual_part_is_max_p_minus_q(argmax_draft):
    p, q = (torch.tensor(x, dtype=torch.float64) for x in PAIRS["overlapping"])
    if argmax_draft:
        q = F.one_hot(q.argmax(), len(q)).double()
    draws = lessons.speculative_draws(p, q, N, seed=2, argmax_draft=argmax_draft)
    for measured, expected in ((draws.accepted, torch.minimum(p, q)), (draws.resampled, (p - q).clamp(min=0))):
        freq = measured.double() / N
        sigma = (expected * (1 - expected) / N).sqrt()
        assert ((freq - expected).abs() <= 5 * sigma + 1e-9).all(), (freq, expected)  # 5 sigma per token
    alpha = float(torch.minimum(p, q).sum())  # 1 - TV; for argmax drafts p(argmax q)
    assert abs(draws.acceptance_rate - alpha) <= 5 * (alpha * (1 - alpha) / N) ** 0.5
    if argmax_draft:
        assert alpha == pytest.approx(float(p[q.argmax()]))


def test_the_fit_test_has_power():
    # Negative control: a wrong verifier that resamples from p (not the residual) after a rejection
    # emits min(p, q) + (1 - α)·p, not p; the same chi-square test must reject it.
    p, q = PAIRS["overlapping"]
    draws = lessons.speculative_draws(p, q, N, seed=3)
    rejected = int(draws.resampled.sum())
    wrong = draws.accepted + torch.bincount(torch.multinomial(torch.tensor(p), rejected, replacement=True,
                                                              generator=torch.Generator().manual_seed(4)),
                                            minlength=len(p))
    assert chi_square(wrong, p) > 10 * CHI2_5DOF_999
    # ...and so must the drafts themselves (no verification at all).
    drafts = torch.bincount(torch.multinomial(torch.tensor(q), N, replacement=True,
                                              generator=torch.Generator().manual_seed(5)), minlength=len(p))
    assert chi_square(drafts, p) > 10 * CHI2_5DOF_999


def test_tokens_the_target_never_emits_never_come_out():
    p = [0.0, 0.5, 0.0, 0.5]
    q = [0.7, 0.1, 0.1, 0.1]  # the draft mostly proposes token 0, which the target gives probability 0
    for argmax_draft in (False, True):
        draws = lessons.speculative_draws(p, q, 20_000, seed=6, argmax_draft=argmax_draft)
        assert draws.counts[0] == 0 and draws.counts[2] == 0


def test_draws_are_seeded_and_validated():
    p, q = PAIRS["overlapping"]
    a, b = lessons.speculative_draws(p, q, 500, seed=7), lessons.speculative_draws(p, q, 500, seed=7)
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.resampled, b.resampled)
    assert not torch.equal(a.counts, lessons.speculative_draws(p, q, 500, seed=8).counts)
    with pytest.raises(ValueError, match="same length"):
        lessons.speculative_draws(p, q[:5], 100)
    with pytest.raises(ValueError, match="n must be"):
        lessons.speculative_draws(p, q, 0)
    with pytest.raises(ValueError, match="non-negative"):
        lessons.speculative_draws([0.5, -0.5, 1.0], [0.3, 0.3, 0.4], 10)


def test_figures_draw_what_the_draws_say():
    p, q = PAIRS["overlapping"]
    fig = lessons.acceptance_figure(p, q, n=3000, seed=9)
    left, right = fig.axes
    assert f"{float(torch.minimum(torch.tensor(p), torch.tensor(q)).sum()):.3f}" in left.get_title()
    draws = lessons.speculative_draws(p, q, 3000, seed=9)
    heights = [bar.get_height() for bar in right.patches]  # accepted bars, then residual bars
    assert heights == pytest.approx((torch.cat([draws.accepted, draws.resampled]).double() / 3000).tolist())
    fig = lessons.convergence_figure(p, q, ns=(10, 100, 1000))
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["n = 10", "n = 100", "n = 1,000"]


def test_explorer_redraws_when_a_slider_moves():
    explorer = lessons.acceptance_explorer(V=6, n=1000, seed=0)
    c = explorer.controls
    image, readout, q, draws = explorer.image.value, explorer.readout.value, explorer.q, explorer.draws
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    assert torch.allclose(draws.q, q) and draws.n == 1000

    c["q_peak"].value = 4
    assert not torch.allclose(explorer.q, q)
    assert explorer.q.argmax() == 4 and torch.allclose(explorer.draws.q, explorer.q)
    assert explorer.image.value != image and explorer.readout.value != readout

    c["p_spread"].value = 2.5
    assert torch.allclose(explorer.draws.p, lessons.shaped_distribution(6, c["p_peak"].value, 2.5))

    c["draft"].value = "argmax of q"  # a deterministic drafter: q one-hot, acceptance p(argmax q)
    assert explorer.draws.q.tolist() == F.one_hot(torch.tensor(4), 6).double().tolist()
    assert "p(argmax q)" in explorer.readout.value
    assert f"{float(explorer.p[4]):.3f}" in explorer.readout.value

    c["n"].value = 100_000
    assert explorer.draws.n == 100_000 and explorer.draws.tv < 0.01
    before = explorer.draws.counts.clone()
    explorer.again.click()  # "draw again": a new seed, new draws
    assert explorer.seed == 1 and not torch.equal(explorer.draws.counts, before)
    assert "application/vnd.jupyter.widget-view+json" in explorer._repr_mimebundle_()


def test_speedup_curve_is_the_cost_model():
    taus, draft_costs = [1.0, 1.5, 2.5, 4.0], [0.0, 0.3, 1.0]
    table = lessons.speedup_curves(taus, draft_costs, c_target=2.0, c_verify=2.2)
    for c_d in draft_costs:
        assert table[c_d] == pytest.approx([costs.speedup(t, 2.0, c_d, 2.2) for t in taus])

    fig = lessons.speedup_curve(draft_costs=(0.0, 0.5), c_target=1.0, c_verify=1.1, max_tau=5.0,
                            marks={"n-gram": (2.0, 0.0)})
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines() if line.get_label().startswith("C_d")}
    assert list(lines) == ["C_d = 0·C_t   (τ* = 1.10)", "C_d = 0.5·C_t   (τ* = 1.60)"]
    for c_d, line in zip((0.0, 0.5), lines.values()):
        x, y = line.get_data()
        for i in (0, 20, 40, 80):  # τ = 1, 2, 3, 5 on the 81-point grid
            assert y[i] == pytest.approx(costs.speedup(float(x[i]), 1.0, c_d, 1.1))
    # the break-even dots sit at (τ*, 1), and the measured star on the C_d = 0 prediction
    dots = [line.get_data() for line in ax.get_lines() if line.get_marker() == "o"]
    assert [float(v) for x, y in dots for v in (x[0], y[0])] == pytest.approx([1.1, 1.0, 1.6, 1.0])
    (star,) = [line.get_data() for line in ax.get_lines() if line.get_marker() == "*"]
    assert float(star[1][0]) == pytest.approx(costs.speedup(2.0, 1.0, 0.0, 1.1))


def test_verification_table_shows_each_fate():
    words = ["def", "main", "(", ")", ":", "self"]
    target = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 5, 3, 4]])  # the target's argmax at positions 1..5
    drafts = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    p = F.one_hot(target, len(words)).float()
    res = verify(drafts, p)
    assert res.accepted.tolist() == [4, 2]
    html = lessons.verification_table(drafts, p, res, words).data
    assert "sequence 0: 4 of 4 drafts accepted → 5 tokens" in html
    assert "sequence 1: 2 of 4 drafts accepted → 3 tokens" in html
    assert "<small>bonus</small>" in html and "<small>correction</small>" in html
    assert html.count("line-through") == 2 + 1  # two rejected drafts, and the legend's key
    assert "cycle boundary" not in html  # a single verification has no cycles to separate


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_gemma(layers=2, seed=0), tiny_gemma(layers=1, seed=1)


@torch.no_grad()
def test_draft_agreement_matches_a_direct_computation(tiny_pair):
    target, draft = tiny_pair
    text = torch.randint(3, 4096, (20,), generator=torch.Generator().manual_seed(0))
    # the draft model is the target: p = q, so every sampled draft is accepted; argmax drafts get max p
    same = lessons.draft_agreement(target, target, [text], temperature=1.0, starts=5)
    p = sampling_probs(target(input_ids=text[None]).logits[0, 5:], 1.0)
    assert same.positions == 15
    assert same.sampled == pytest.approx(1.0, abs=1e-5)
    assert same.argmax == pytest.approx(float(p.max(-1).values.mean()), abs=1e-5)

    at0 = lessons.draft_agreement(target, draft, [text, text[:12]], temperature=0.0, starts=[0, 3])
    agree = [target(input_ids=t[None]).logits[0, s:].argmax(-1) == draft(input_ids=t[None]).logits[0, s:].argmax(-1)
             for t, s in ((text, 0), (text[:12], 3))]
    assert at0.positions == 29
    assert at0.sampled == pytest.approx(float(torch.cat(agree).double().mean()))  # T = 0: both are
    assert at0.argmax == pytest.approx(at0.sampled)  # "the argmaxes agree"


def test_temperature_sweep_runs_every_drafter_at_every_temperature(tiny_pair):
    target, draft = tiny_pair
    prompts = [torch.randint(3, 4096, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]
    drafters = {"sampled": DraftLMDrafter(draft, num_draft_tokens=3),
                "argmax": DraftLMDrafter(draft, num_draft_tokens=3, argmax_drafts=True),
                "ngram": NGramDrafter(4096, num_draft_tokens=3)}
    sweep = lessons.temperature_sweep(target, drafters, prompts, [0.0, 1.0], max_new_tokens=6, seed=0)
    assert set(sweep.tau) == set(drafters) and all(len(v) == 2 for v in sweep.tau.values())
    assert all(1 <= t <= 4 for v in sweep.tau.values() for t in v)
    ref = autoregressive_generate(target, prompts, 6)
    for name in drafters:  # T = 0: every drafter gives the greedy output
        assert torch.equal(sweep.runs[name][0].tokens, ref.tokens)
        assert [len(t) for t in sweep.texts(name, 0)] == [9 + 6, 14 + 6]
    pred = lessons.predicted_acceptance(target, draft, sweep, "sampled")
    assert all(len(v) == 2 and all(0 <= x <= 1 for x in v) for v in pred.values())
    text = lessons.rate_table(sweep.temperatures, {"τ sampled": sweep.tau["sampled"], **pred})
    assert text.splitlines()[0].startswith("T ") and len(text.splitlines()) == 3


@pytest.mark.parametrize("path", sorted(NOTEBOOK.parent.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebooks_are_stored_without_outputs_and_with_jupyterlabs_metadata(path):
    """No outputs, and the kernelspec / language_info JupyterLab itself writes: otherwise opening a notebook marks
    it modified before the learner has touched it (tests/test_browser.py checks that on notebook 01). Cell ids too."""
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert any("minispec" in "".join(c["source"]) for c in code)
    assert nb["metadata"]["kernelspec"] == {"display_name": "Python 3 (ipykernel)", "language": "python",
                                            "name": "python3"}
    assert nb["metadata"]["language_info"] == json.loads(NOTEBOOK.read_text())["metadata"]["language_info"]
    assert nb["metadata"]["language_info"]["pygments_lexer"] == "ipython3"
    ids = [c.get("id") for c in nb["cells"]]  # nbformat 4.5: every cell has its own id
    assert None not in ids and len(set(ids)) == len(ids)


# --- notebook 02's figures (minispec/lessons/dflash.py) ---------------------------------------------------

def test_e4b_taps_are_five_of_its_seven_full_attention_layers_as_the_write_up_says():
    from matplotlib.colors import to_hex

    from minispec.lessons import dflash

    full = [i for i, kind in enumerate(dflash.E4B_LAYER_TYPES) if kind == "full_attention"]
    assert len(dflash.E4B_LAYER_TYPES) == 42 and full == [5, 11, 17, 23, 29, 35, 41]
    assert dflash.E4B_LAYER_TYPES.count("sliding_attention") == 35
    assert set(dflash.E4B_TAPS) == set(full) - {29, 41}
    fig = dflash.tap_map({"E4B": (dflash.E4B_LAYER_TYPES, dflash.E4B_TAPS)})
    ax = fig.axes[0]
    outlined = [p for p in ax.patches if p.get_linewidth() > 0]
    assert [round(p.get_x()) for p in outlined] == list(dflash.E4B_TAPS)
    assert {to_hex(p.get_facecolor()) for p in outlined} == {dflash.FULL_COLOR}  # 35 drawn as full attention
    numbers = {t.get_text(): to_hex(t.get_color()) for t in ax.texts}
    assert numbers == {str(i): dflash.TAP_COLOR if i in dflash.E4B_TAPS else dflash.FULL_COLOR for i in full}


def test_speed_figure_draws_the_cost_model_and_both_speedups():
    from minispec.lessons import dflash

    row = {"tau": 3.0, "speedup": 1.4, "C_t_ms": 10.0, "C_d_ms": 4.0, "C_v_ms": 12.0, "predicted_speedup": 1.875}
    fig = dflash.speed_figure({"toy": row}, max_tau=6.0)
    lines = fig.axes[0].lines
    curve = next(line for line in lines if len(line.get_xdata()) == 50)
    assert curve.get_ydata() == pytest.approx([t / 1.6 for t in curve.get_xdata()])  # tau* = (4 + 12) / 10
    marks = {line.get_marker(): (line.get_xdata()[0], line.get_ydata()[0]) for line in lines
             if len(line.get_xdata()) == 1}
    assert marks["o"] == pytest.approx((1.6, 1.0))
    assert marks["*"] == pytest.approx((3.0, costs.speedup(3.0, 10.0, 4.0, 12.0)))
    assert marks["D"] == pytest.approx((3.0, 1.4))
    with pytest.raises(ValueError, match="lacks"):
        dflash.speed_figure({"toy": {"tau": 3.0}})
    with pytest.raises(ValueError, match="at least one"):
        dflash.speed_figure({})
