"""Notebook 02's library pieces: the bench's measurements, one verify step per drafting rule, the figures."""
import matplotlib
import pytest
import torch

import minispec as ms
from minispec import costs
from minispec.bench.dflash import acceptance, argmax_ceiling, side_by_side
from minispec.dflash import mask as dmask
from minispec.dflash.config import DFlashConfig
from minispec.dflash.drafter import DFlashDrafter
from minispec.dflash.model import DFlashDraftModel
from minispec.drafters import NGramDrafter
from minispec.lessons import dflash as lessons
from minispec.speculative import sampling as smp
from tiny import tiny_gemma

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def target():
    return tiny_gemma(layers=4, window=16, seed=0)


@pytest.fixture(scope="module")
def model(target):
    torch.manual_seed(1)
    cfg = DFlashConfig.for_target(target.config, [1, 2], 3, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  sliding_window=16, block_size=8)
    return DFlashDraftModel.for_target(cfg, target)


def prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 4096, (int(length),), generator=g) for length in torch.randint(5, 30, (n,), generator=g)]


def test_acceptance_merges_every_batch(target):
    ps = prompts(5)
    merged, continuations = acceptance(target, NGramDrafter(4096), ps, 12, temperature=0.0, batch_size=2)
    whole = ms.speculative_generate(target, NGramDrafter(4096), ps, 12)
    assert len(merged.verifications) == len(whole.stats.verifications)
    assert merged.tau == pytest.approx(whole.stats.tau)
    assert [c.tolist() for c in continuations] == [row[:n].tolist() for row, n in zip(whole.tokens, whole.lengths)]


def test_side_by_side_predicts_from_isolated_costs(target, model):
    row = side_by_side(target, DFlashDrafter(model, target), prompts(2, seed=1), 8, temperature=0.0, repeats=1)
    assert row["C_t_ms"] > 0 and row["C_d_ms"] > 0 and row["C_v_ms"] > 0
    assert row["tau"] >= 1 and row["identical_to_ar"] is True
    assert row["predicted_speedup"] == pytest.approx(
        costs.speedup(row["tau"], row["C_t_ms"], row["C_d_ms"], row["C_v_ms"]), rel=0.02)
    assert row["overhead_ms"] == pytest.approx(row["cycle_ms"] - row["C_d_ms"] - row["C_v_ms"], abs=0.02)


def test_tap_map_outlines_exactly_the_taps():
    fig = lessons.tap_map({"a": (["sliding_attention"] * 5 + ["full_attention"], [1, 5]),
                           "b": (["full_attention"] * 4, [0])})
    outlined = [sum(p.get_linewidth() > 0 for p in ax.patches) for ax in fig.axes]
    assert outlined == [2, 1]


def test_mask_figure_draws_the_training_mask():
    fig = lessons.mask_figure(seq_len=12, anchors=(2, 6), block_size=3, window=5, padding_blocks=1)
    shown = fig.axes[0].images[0].get_array()
    expected = dmask.training_mask(torch.tensor([[2, 6, 0]]), torch.tensor([[True, True, False]]), 12, 3, 5)[0]
    assert torch.equal(torch.as_tensor(shown.data).bool(), expected)


def test_param_budget_shares():
    fig = lessons.param_budget({"E4B": costs.dflash_param_count(costs.E4B_DFLASH)})
    widths = [p.get_width() for p in fig.axes[0].patches]
    assert sum(widths) == pytest.approx(1.0)
    assert widths[-1] == pytest.approx(0.651, abs=0.001)  # E4B's own head


def test_argmax_ceiling(target):
    ps = prompts(2)
    continuations = [ms.autoregressive_generate(target, p, 6).tokens[0] for p in ps]
    assert argmax_ceiling(target, ps, continuations, temperature=0.0, K=5, starts=2) == 6.0
    # A random tiny model is nearly uniform over 4,096 tokens: at T = 1 nothing gets accepted.
    assert 1.0 <= argmax_ceiling(target, ps, continuations, temperature=1.0, K=5, starts=2, batch_size=3) < 1.05


def test_argmax_ceiling_is_the_greedy_continuations_acceptance(target):
    """Batched over ragged contexts, it equals 1 + sum_k prod_{j<=k} p_T(d_j) computed one context at a time."""
    ps = prompts(2, seed=3)
    continuations = [ms.autoregressive_generate(target, p, 8, temperature=1.0,
                                                generator=torch.Generator().manual_seed(0)).tokens[0] for p in ps]
    hot = 0.05  # a low temperature: the tiny model's distribution is peaked enough to accept something
    expected = []
    for p, c in zip(ps, continuations):
        text = torch.cat([p, c])
        for start in torch.linspace(len(p), len(text) - 1, 3).long().tolist():
            drafts = ms.autoregressive_generate(target, text[:start], 4).tokens[0]
            with torch.no_grad():
                logits = target(torch.cat([text[:start], drafts])[None]).logits[0, start - 1: start + 3]
            accept = smp.sampling_probs(logits, hot).gather(-1, drafts[:, None])[:, 0]
            expected.append(1 + float(accept.cumprod(0).sum()))
    got = argmax_ceiling(target, ps, continuations, temperature=hot, K=4, starts=3, batch_size=4)
    assert got == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    assert got > 1.05


def test_every_rule_is_exact_and_accepts_as_predicted():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    predicted = {"argmax, one-hot": float(p[q.argmax()]), "sampled, one-hot": float((p * q).sum()),
                 "sampled, told q": float(torch.minimum(p, q).sum())}
    for rule, rate in predicted.items():
        dist, accepted = lessons.verify_draws(p, q, rule, n=40_000)
        # TV to p within sampling noise (about sqrt(V / n) ~ 0.01); acceptance within 3 standard errors.
        assert 0.5 * float((dist - p).abs().sum()) < 0.015, rule
        assert accepted == pytest.approx(rate, abs=3 * (rate * (1 - rate) / 40_000) ** 0.5 + 1e-3), rule
    with pytest.raises(ValueError, match="unknown rule"):
        lessons.verify_draws(p, q, "nonsense")


def test_window_choice_draws_the_pick():
    rows = [{"K": k, "expected_tau": 1 + 0.3 * k ** 0.5, "C_t_ms": 40.0, "C_d_ms": 5.0, "C_v_ms": 40.0 + 3 * k,
             "predicted_speedup": 0.0, "picked": k == 2} for k in range(1, 8)]
    for r in rows:
        r["predicted_speedup"] = costs.speedup(r["expected_tau"], r["C_t_ms"], r["C_d_ms"], r["C_v_ms"])
    fig = lessons.window_choice(rows)
    left, right = fig.axes
    assert list(left.lines[1].get_ydata()) == pytest.approx([(45 + 3 * k) / 40 for k in range(1, 8)])
    star = right.lines[1]
    assert list(star.get_xdata()) == [2] and list(star.get_ydata()) == [rows[1]["predicted_speedup"]]
    with pytest.raises(ValueError, match="pick_draft_tokens"):
        lessons.window_choice([{"K": 1}])


def test_walk_figure_marks_the_visited_positions():
    runs = [0, 0, 0, 0, 7, 6, 5, 4, 3, 2, 1, 0]
    fig = lessons.walk_figure([runs, [1, 0]])
    one, hist = fig.axes
    every, visited = one.containers
    assert [b.get_height() for b in every] == [1 + r for r in runs]  # the longest reply
    assert [round(b.get_x() + b.get_width() / 2) for b in visited] == [0, 1, 2, 3, 4]
    every, drafted = hist.containers  # shares of tau 1 .. 8 over 14 positions and over 5 + 1 cycles
    assert [round(b.get_height() * 14) for b in every] == [6, 2, 1, 1, 1, 1, 1, 1]
    assert [round(b.get_height() * 6) for b in drafted] == [4, 1, 0, 0, 0, 0, 0, 1]
    assert "14 tokens in 6 cycles" in hist.get_title()
    with pytest.raises(ValueError, match="at least one reply"):
        lessons.walk_figure([[]])
