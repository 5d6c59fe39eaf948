"""Checkers for the exercise notebooks (01x .. 06x): `check(name, fn)` says whether `fn` is right.

    from minispec.exercises import check
    check("verify_step", verify_step)      # shows a green, red or grey box in a notebook

The learner's function is run on fixed cases (exact edge cases first, then, where the answer is random,
a χ² test against the exact distribution under fixed random seeds). A wrong answer is never an
exception: it is a failed `CheckResult` whose message names the likely mistake; an exception raised
inside `fn` is reported the same way, and a `NotImplementedError` (the blank as shipped) reads
"not done yet". Only misuse of `check` itself raises (an unknown name, an `fn` that is not callable).

The exercises, by notebook:

    01x  verify_step      one verification step of speculative sampling
    02x  dflash_mask      the DFlash training mask of one sequence
    03x  mtp_draft        the recursive drafting loop of an MTP head
    03x  boost_loss       the boosting loss: per-depth KL(backbone ‖ head) and 1 − TV
    04x  e2m1_round       rounding to the E2M1 grid
    04x  nvfp4_scales     the two-level NVFP4 scales of one tensor
    04x  qad_kl           the QAD loss: KL(teacher ‖ student) at a temperature, over a mask
    05x  replay_verify    the checkpoint + replay verify step of one Mamba-2 layer
    05x  replay_cycles    commit and flush: speculative cycles over one checkpoint
    06x  forward_seconds  the roofline cost of one forward at a batch
    06x  break_even_batch the batch at which speculative decoding stops paying

Teachers' answers: `minispec.exercises.solutions`.
"""
from __future__ import annotations

from minispec.exercises import mask, mtp, nvfp4, replay, serving, verify
from minispec.exercises.result import CheckResult, NotDone, Wrong

CHECKERS = {
    "verify_step": verify.check_verify_step,
    "dflash_mask": mask.check_dflash_mask,
    "mtp_draft": mtp.check_mtp_draft,
    "boost_loss": mtp.check_boost_loss,
    "e2m1_round": nvfp4.check_e2m1_round,
    "nvfp4_scales": nvfp4.check_nvfp4_scales,
    "qad_kl": nvfp4.check_qad_kl,
    "replay_verify": replay.check_replay_verify,
    "replay_cycles": replay.check_replay_cycles,
    "forward_seconds": serving.check_forward_seconds,
    "break_even_batch": serving.check_break_even_batch,
}

__all__ = ["check", "CheckResult", "CHECKERS"]


def check(name: str, fn) -> CheckResult:
    """Run the checker of exercise `name` on the learner's function `fn`; never raises for a wrong answer."""
    if name not in CHECKERS:
        raise ValueError(f"unknown exercise {name!r}; the exercises are {', '.join(CHECKERS)}")
    if not callable(fn):
        raise TypeError(f"check({name!r}, fn): fn must be the function you wrote, got {type(fn).__name__}")
    try:
        message = CHECKERS[name](fn)
    except NotDone:
        return CheckResult(name, False, "not done yet: fill in the function above (it still raises "
                                        "NotImplementedError), run its cell, then run this one again.", done=False)
    except Wrong as wrong:
        return CheckResult(name, False, str(wrong))
    return CheckResult(name, True, message)
