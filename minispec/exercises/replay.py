"""Checkers of exercise 05x: the checkpoint + replay verify step of one Mamba-2 layer (one sequence, one group),
and commit + flush over speculative cycles (`replay_cycles`, below).

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


# -- exercise 2: commit and flush ----------------------------------------------------------------------------
#
#     replay_cycles(checkpoint [H, P, N], cycles, A [H], D [H], capacity: int) -> [(y [T, H, P], checkpoint)]
#
# cycles: (x [T, H, P], dt [T, H], B [T, N], C [T, N], n) per speculative cycle; the first n tokens of its
# window are kept. The store holds one checkpoint and at most `capacity` records; `count` are committed.
#     verify: if count + T > capacity, flush first (fold the count committed records into the checkpoint,
#             count = 0); the window's records go after the committed ones, over any rejected ones; y from
#             the checkpoint and records 0 .. count + T - 1 (exercise 1)
#     commit: count += n (the rejected records are simply not counted)
# Each cycle returns its window's y and the checkpoint after its commit: it changes only at a flush.

def _cycles_case(seed: int, schedule: tuple[tuple[int, int], ...]):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    A = -(torch.rand(H, generator=g, dtype=torch.float64) + 0.5)
    cycles = [(randn(T, H, P), torch.rand(T, H, generator=g, dtype=torch.float64) * 0.8 + 0.2, randn(T, N),
               randn(T, N), n) for T, n in schedule]
    return randn(H, P, N), cycles, A, randn(H)


def _fold(checkpoint, x, dt, B, A):
    S = checkpoint.clone()
    for i in range(x.shape[0]):
        S = torch.exp(dt[i] * A)[:, None, None] * S + (dt[i][:, None] * x[i])[:, :, None] * B[i]
    return S


def _cycles_variant(checkpoint, cycles, A, D, capacity, *, mode="replay", keep="n", fold="committed",
                    flush_when="overflow"):
    """The store with one of the usual mistakes switched on: mode "recurrence" runs one state through every
    window token; "rollback" folds the kept tokens into the checkpoint at every commit (per-position states)."""
    ck = checkpoint.clone()
    rec_x, rec_dt, rec_B = [], [], []  # the ring, committed records first
    count, out = 0, []
    for x, dt, B, C, n in cycles:
        T = x.shape[0]
        if mode == "recurrence":
            y = _variant(ck, x, dt, B, C, A, D, 0)
            ck = _fold(ck, x, dt, B, A)
            out.append((y, ck.clone()))
            continue
        full = count + T > capacity if flush_when == "overflow" else count + T >= capacity
        if full:
            m = count if fold == "committed" else len(rec_x)
            ck = _fold(ck, torch.stack(rec_x[:m]), torch.stack(rec_dt[:m]), torch.stack(rec_B[:m]), A) if m else ck
            rec_x, rec_dt, rec_B, count = [], [], [], 0
        rec_x, rec_dt, rec_B = rec_x[:count] + list(x), rec_dt[:count] + list(dt), rec_B[:count] + list(B)
        y = _reference(ck, torch.stack(rec_x), torch.stack(rec_dt), torch.stack(rec_B), C, A, D, count)
        count += n if keep == "n" else T
        if mode == "rollback":
            ck = _fold(ck, torch.stack(rec_x[:count]), torch.stack(rec_dt[:count]), torch.stack(rec_B[:count]), A)
            rec_x, rec_dt, rec_B, count = [], [], [], 0
        out.append((y, ck.clone()))
    return out


CYCLE_MISTAKES = {
    "rollback": {"mode": "rollback"},
    "recurrence": {"mode": "recurrence"},
    "keep_window": {"keep": "T"},
    "fold_ring": {"fold": "ring"},
    "flush_early": {"flush_when": "fits"},
}
CYCLE_MESSAGES = {
    "rollback": "the checkpoint is rewritten at every commit (the state after the kept tokens, as per-position "
                "states do): checkpoint + replay writes it only at a flush, when the next window does not fit "
                "(count + T > capacity); a commit only counts records",
    "recurrence": "one state runs through every window token, rejected drafts included: a Mamba state cannot be "
                  "cropped, so the next window must be replayed from the checkpoint and the committed records only",
    "keep_window": "commit keeps the whole window: count must grow by n, the kept tokens, so the rejected records "
                   "are overwritten by the next window",
    "fold_ring": "the flush folds every record in the ring, rejected ones too: fold only the `count` committed ones",
    "flush_early": "the flush comes one window early (count + T >= capacity): flush only when the window does not "
                   "fit, count + T > capacity",
}

SCHEDULES = (  # (T, n) per cycle; capacity
    (((4, 2), (4, 1), (4, 1), (4, 3), (4, 2)), 8),
    (((3, 3), (3, 1), (2, 2), (3, 2), (3, 1), (3, 3)), 6),
    (((2, 1), (2, 2), (2, 1)), 2),
)


def check_replay_cycles(fn) -> str:
    for seed, (schedule, capacity) in enumerate(SCHEDULES):
        checkpoint, cycles, A, D = _cycles_case(10 + seed, schedule)
        want = _cycles_variant(checkpoint, cycles, A, D, capacity)

        fresh = [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in c) for c in cycles]
        got = call(fn, checkpoint.clone(), fresh, A.clone(), D.clone(), capacity)
        if not isinstance(got, (list, tuple)) or len(got) != len(cycles):
            raise Wrong(f"replay_cycles must return one (y, checkpoint) pair per cycle ({len(cycles)}), got "
                        f"{type(got).__name__}{'' if not hasattr(got, '__len__') else f' of {len(got)}'}")
        where = f"capacity {capacity}, cycles (T, n) = {list(schedule)}"
        shaped = []
        for c, (pair, (y_want, _)) in enumerate(zip(got, want)):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise Wrong(f"cycle {c}: expected a pair (y, checkpoint), got {type(pair).__name__}")
            shaped.append((as_tensor(pair[0], f"cycle {c}'s y", tuple(y_want.shape)).double(),
                           as_tensor(pair[1], f"cycle {c}'s checkpoint", (H, P, N)).double()))

        def same(a, b):
            return all(torch.allclose(ya, yb, rtol=1e-5, atol=1e-6) and torch.allclose(ca, cb, rtol=1e-5, atol=1e-6)
                       for (ya, ca), (yb, cb) in zip(a, b))

        if same(shaped, want):
            continue
        for name, flags in CYCLE_MISTAKES.items():
            if same(shaped, _cycles_variant(checkpoint, cycles, A, D, capacity, **flags)):
                raise Wrong(f"{where}: {CYCLE_MESSAGES[name]}.")
        for c, ((y, ck), (y_want, ck_want)) in enumerate(zip(shaped, want)):
            if not torch.allclose(y, y_want, rtol=1e-5, atol=1e-6):
                raise Wrong(f"{where}: cycle {c}'s outputs differ from the replay (by up to "
                            f"{(y - y_want).abs().max().item():.3g}); the window reads the checkpoint, the committed "
                            "records and its own records, nothing rejected")
            if not torch.allclose(ck, ck_want, rtol=1e-5, atol=1e-6):
                flushed = c == 0 or not torch.equal(want[c - 1][1], ck_want)
                why = ("a flush happens before this window: fold the committed records into it" if flushed
                       else "no flush is due here, so it must be the previous checkpoint, unchanged")
                raise Wrong(f"{where}: the checkpoint after cycle {c} is wrong; {why}")
    return ("Outputs and checkpoints match on 3 schedules: the checkpoint is written only when a window does not fit, "
            "and rejected drafts are forgotten by not counting their records.")
