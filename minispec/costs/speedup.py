"""The speedup model of speculative decoding and its break-even point.

One speculative cycle drafts, then verifies in one target forward, and emits tau tokens
(accepted drafts + 1, as the papers count it, so tau >= 1). Plain decoding emits one token per
target forward of cost C_t. Hence the speedup formula of the Bolt E4B write-up

    speedup = tau · C_t / (C_d + C_v)

with C_d the cost of drafting one cycle (all draft passes) and C_v the cost of the verify
forward. Costs are in any one unit (ms, FLOPs, bytes moved); only ratios matter. Speculation
pays when speedup > 1, i.e. when tau exceeds the break-even tau* = (C_d + C_v) / C_t.
"""

from __future__ import annotations

from minispec.costs.units import check_nonnegative, check_positive


def check_tau(tau: float) -> None:
    check_positive(tau=tau)
    if tau < 1:
        raise ValueError(f"tau counts accepted drafts + 1 per target forward, so tau >= 1; got {tau}")


def speedup(tau: float, c_target: float, c_draft: float, c_verify: float) -> float:
    """Speculative speedup over plain decoding: tau · C_t / (C_d + C_v).

    ``c_draft`` may be 0 (prompt lookup drafts for free); ``c_target`` and ``c_verify`` must be
    positive. With free drafts and a verify as cheap as one decode step, speedup = tau.
    """
    check_tau(tau)
    check_positive(c_target=c_target, c_verify=c_verify)
    check_nonnegative(c_draft=c_draft)
    return tau * c_target / (c_draft + c_verify)


def break_even_tau(c_target: float, c_draft: float, c_verify: float) -> float:
    """The tau at which speculation neither helps nor hurts: tau* = (C_d + C_v) / C_t.

    May be below 1 in an idealized model (free drafts, verify cheaper than a decode step); any
    real tau >= 1 then wins.
    """
    check_positive(c_target=c_target, c_verify=c_verify)
    check_nonnegative(c_draft=c_draft)
    return (c_draft + c_verify) / c_target


def implied_cycle_cost(tau: float, measured_speedup: float) -> float:
    """(C_d + C_v) / C_t implied by a measured speedup at a measured tau: tau / speedup.

    The cost of one speculative cycle in units of one plain decode step. z-lab's first README
    (z-lab/dflash at commit bb48ef9), Qwen3-8B on GSM8K at T=0: DFlash 6.55 / 5.20x = 1.26 decode steps
    per cycle (one parallel draft pass); EAGLE-3 2.89 / 2.13x = 1.36 (seven sequential passes).
    """
    check_tau(tau)
    check_positive(measured_speedup=measured_speedup)
    return tau / measured_speedup


def expected_tau(acceptance) -> float:
    """E[tau] of a window of K = len(acceptance) drafts: 1 + sum_j prod_{i<=j} a_i.

    a_k is the acceptance rate of draft k given that drafts 1 .. k-1 were accepted (`SpecStats.per_position`);
    the product is the chance that the first j drafts all are. So the acceptance measured with a long window
    predicts the tau of every shorter one: drafts past K are never sent.
    """
    rates = [float(a) for a in acceptance]
    if not rates:
        raise ValueError("expected_tau needs the acceptance of at least one draft position")
    if any(not 0 <= a <= 1 for a in rates):
        raise ValueError(f"acceptance rates are probabilities in [0, 1], got {rates}")
    tau, reach = 1.0, 1.0
    for a in rates:
        reach *= a
        tau += reach
    return tau


def best_window(acceptance, c_target: float, c_draft: dict, c_verify: dict) -> int:
    """The K the cost model picks: argmax over K of speedup(expected_tau(a_1..a_K), C_t, C_d(K), C_v(K)).

    `c_draft` and `c_verify` map each candidate K to its measured cost; a verify over K + 1 tokens costs more
    than a decode step wherever the forward is not bound by reading the weights (a CPU at a few tokens, a GPU
    at a large batch), so the longest window is not always the best. Ties go to the smaller K.
    """
    if set(c_draft) != set(c_verify) or not c_draft:
        raise ValueError(f"c_draft and c_verify must time the same K, got {sorted(c_draft)} and {sorted(c_verify)}")
    if max(c_draft) > len(acceptance) or min(c_draft) < 1:
        raise ValueError(f"K must be 1 .. {len(acceptance)} (the positions whose acceptance was measured), "
                         f"got {sorted(c_draft)}")
    return max(sorted(c_draft), key=lambda k: speedup(expected_tau(acceptance[:k]), c_target, c_draft[k],
                                                      c_verify[k]))
