"""Checker of exercise 05x: the checkpoint + replay verify step of one Mamba-2 layer (one sequence, one group).

    replay_verify(checkpoint [H, P, N], x [L, H, P], dt [L, H], B [L, N], C [T, N], A [H], D [H], start: int)
        -> y [T, H, P]

The records 0 .. L-1 hold `start` committed tokens, then the T = L - start tokens of the verify window.
Window position s reads the checkpoint and records 0 .. start + s, and nothing is written:

    S_i = exp(dt_i A) S_{i-1} + dt_i x_i B_i^T   (S_{-1} = checkpoint),   y_s = S_{start+s} C_s + D x_{start+s}

The answer is compared with `minispec.ssm.replay.replay_verify` in float64; a wrong answer is matched
against the outputs of the usual mistakes.
"""
from __future__ import annotations

import torch

from minispec.exercises.result import Wrong, as_tensor, call
from minispec.ssm.replay import replay_verify

H, P, N = 3, 4, 5


def _case(L: int, start: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    dt = torch.rand(L, H, generator=g, dtype=torch.float64) * 0.8 + 0.2
    A = -(torch.rand(H, generator=g, dtype=torch.float64) + 0.5)
    return randn(H, P, N), randn(L, H, P), dt, randn(L, N), randn(L - start, N), A, randn(H), start


def _reference(checkpoint, x, dt, B, C, A, D, start) -> torch.Tensor:
    return replay_verify(checkpoint[None], x[None], dt[None], B[None, :, None], C[None, :, None], A, D, start)[0]


def _variant(checkpoint, x, dt, B, C, A, D, start, *, skip=False, decay_after=False, window_only=False,
             no_dt=False) -> torch.Tensor:
    """The recurrence with one of the usual mistakes switched on."""
    S = checkpoint.clone()
    ys = []
    for i in range(start if window_only else 0, x.shape[0]):
        a = torch.exp(dt[i] * A)[:, None, None]
        add = (x[i] if no_dt else dt[i][:, None] * x[i])[:, :, None] * B[i]
        S = a * (S + add) if decay_after else a * S + add
        if i >= start:
            ys.append(S @ C[i - start] + (0 if skip else D[:, None] * x[i]))
    return torch.stack(ys)


MISTAKES = {
    "skip": "the skip term is missing: y_s = S C_s + D x_s",
    "decay_after": "each record is decayed by its own step too: S_i = exp(dt_i A) S_{i-1} + dt_i x_i B_i^T decays "
                   "the earlier state, then adds record i undecayed",
    "window_only": "the committed records 0 .. start-1 are skipped: the checkpoint is the state before record 0, "
                   "so every record since it (committed ones first) must be replayed",
    "no_dt": "dt is missing from the input term: add dt_i x_i B_i^T",
}


def check_replay_verify(fn) -> str:
    for L, start, seed in ((7, 3, 0), (4, 0, 1), (6, 5, 2)):
        args = _case(L, start, seed)
        want = _reference(*args)
        got = as_tensor(call(fn, *(a.clone() if isinstance(a, torch.Tensor) else a for a in args)),
                        f"replay_verify(L={L}, start={start})", tuple(want.shape))
        if torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6):
            continue
        where = f"L = {L} records, start = {start} (window of T = {L - start})"
        for flag, mistake in MISTAKES.items():
            if torch.allclose(got.double(), _variant(*args, **{flag: True}), rtol=1e-5, atol=1e-6):
                raise Wrong(f"{where}: {mistake}.")
        if torch.allclose(got.double()[-1], want[-1], rtol=1e-5, atol=1e-6):
            raise Wrong(f"{where}: the last window position is right but earlier ones are not: position s reads the "
                        "records 0 .. start + s only, never the later ones (a causal window)")
        err = (got.double() - want).abs().max().item()
        s = int((got.double() - want).abs().flatten(1).amax(1).argmax())
        raise Wrong(f"{where}: y differs from the replay by up to {err:.3g}, first at window position {s}. "
                    "S_i = exp(dt_i A) S_{i-1} + dt_i x_i B_i^T from the checkpoint, y_s = S_{start+s} C_s + D x.")
    return "Exact (to float64 rounding) on 3 windows: after committed records, from a fresh checkpoint, and T = 1."
