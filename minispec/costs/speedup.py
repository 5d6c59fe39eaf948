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
