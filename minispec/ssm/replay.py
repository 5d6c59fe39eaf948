"""Speculative verification over a Mamba-2 layer: per-position states vs checkpoint + replay.

A KV cache rolls back by cropping: the entries of rejected drafts are simply forgotten. A Mamba state
cannot be cropped: after a verify window of T tokens it has absorbed all of them, and nothing in the
P x N matrix says which part came from which token. Two exact ways out, behind one interface
(`MambaLayerStore`: `verify(u)` a window, `commit(n)` keep its first n tokens, `extend(u)` prefill):

* `PerPositionStates` (what vLLM / SGLang do natively): while verifying, write the state after every
  window position (T states, SSM and conv); commit(n) keeps the n-th. Traffic per step: read 1 state,
  write T states.
* `CheckpointReplay`: the Mamba checkpoint + replay of "Nemotron 3.5 Super and Lightning: Open,
  Efficient Mixture-of-Experts Hybrid Mamba-Transformer Models for Agentic AI" (the same idea as Dao AI
  Lab's ReplaySSM, "Cache SSM Inputs, Not State", and TensorRT-LLM's checkpointing replay, PR #14203).
  Keep one checkpoint S0 and a ring of per-token records since it (x, B, dt and the pre-conv column
  for the conv window). The window's outputs come from S0 plus the records (`replay_verify`, no state
  is written); a rejected draft only leaves the counter where it is; when the next window would not
  fit, the committed records are folded into a new checkpoint (`replay_flush`), written once.

The algebra (notation of `minispec.ssm.ssd`; l_i = dt_i * A, cum_t = l_1 + ... + l_t over the
records since the checkpoint, C_t read fresh from the current token):

    S_t = exp(cum_t) S0 + sum_{i<=t} exp(cum_t - cum_i) dt_i x_i B_i^T
    y_t = exp(cum_t) (S0 C_t) + sum_{i<=t} (C_t . B_i) dt_i exp(cum_t - cum_i) x_i + D x_t

The checkpoint term decays through every record 1..t (t's own included); record i only through
i+1..t (its own decay acts before it is added), so the record sum uses cum_t - cum_i, not
cum_t - cum_{i-1}.

`replay_verify` and `replay_flush` have Triton twins in `kernels/replay.py` with the same signatures;
both sides check their arguments with `check_replay_verify_args` / `check_replay_flush_args`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from minispec.backend import dispatch
from minispec.ssm.mamba2 import Mamba2Mixer
from minispec.ssm.ssd import expand_groups, ssd_step
from minispec.ssm.state import Mamba2State, Mamba2StateError, check_state, state_dtype

__all__ = [
    "replay_verify",
    "replay_flush",
    "check_replay_verify_args",
    "check_replay_flush_args",
    "Traffic",
    "StepTraffic",
    "MambaLayerStore",
    "PerPositionStates",
    "CheckpointReplay",
    "STRATEGIES",
    "make_store",
]


def check_replay_flush_args(checkpoint: Tensor, x: Tensor, dt: Tensor, B: Tensor, A: Tensor,
                            fn: str = "replay_flush") -> None:
    """Raise ValueError naming the problem, for checkpoint and records `replay_flush` (reference and kernel)
    must refuse. `fn` names the caller in the message: `check_replay_verify_args` checks its records here."""
    if checkpoint.dim() != 4:
        raise ValueError(f"{fn}: checkpoint must be [b, H, P, N], got {tuple(checkpoint.shape)}")
    b, H, P, N = checkpoint.shape
    if x.dim() != 4 or x.shape[0] != b or x.shape[2:] != (H, P):
        raise ValueError(f"{fn}: x must be [b, L, H, P] = [{b}, L, {H}, {P}], got {tuple(x.shape)}")
    L = x.shape[1]
    if tuple(dt.shape) != (b, L, H):
        raise ValueError(f"{fn}: dt must be [b, L, H] = {(b, L, H)}, got {tuple(dt.shape)}")
    if B.dim() != 4 or B.shape[:2] != (b, L) or B.shape[3] != N or H % B.shape[2]:
        raise ValueError(f"{fn}: B must be [b, L, G, N] = [{b}, {L}, G, {N}] with G dividing H, got {tuple(B.shape)}")
    if tuple(A.shape) != (H,):
        raise ValueError(f"{fn}: A must be [H] = ({H},), got {tuple(A.shape)}")


def check_replay_verify_args(checkpoint: Tensor, x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor,
                             start: int) -> None:
    """Raise ValueError naming the problem, for anything `replay_verify` (reference and kernel) must refuse."""
    check_replay_flush_args(checkpoint, x, dt, B, A, fn="replay_verify")
    b, L, H, _ = x.shape
    G, N = B.shape[2], B.shape[3]
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < L:
        raise ValueError(f"replay_verify: start must be an int in [0, L) = [0, {L}), got {start!r}")
    T = L - start
    if tuple(C.shape) != (b, T, G, N):
        raise ValueError(f"replay_verify: C must be [b, T, G, N] = {(b, T, G, N)}, got {tuple(C.shape)}")
    if tuple(D.shape) != (H,):
        raise ValueError(f"replay_verify: D must be [H] = ({H},), got {tuple(D.shape)}")


@dispatch("replay:replay_verify")
def replay_verify(checkpoint: Tensor, x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor,
                  start: int) -> Tensor:
    """Outputs of a verify window read from the checkpoint plus the records; no state is formed.

    checkpoint [b, H, P, N]   S0, the state before record 0
    x [b, L, H, P], dt [b, L, H] (after softplus), B [b, L, G, N]
                              records 0..L-1: `start` committed ones, then the T = L - start of the window
    C [b, T, G, N]            the window's C (never cached); A [H] (< 0); D [H]
    returns y [b, T, H, P]:   window position s reads records 0..start+s (a causal mask over the window)
        y_s = exp(cum_{w}) (S0 C_s) + sum_{i<=w} (C_s . B_i) dt_i exp(cum_w - cum_i) x_i + D x_s,  w = start+s
    Computed in the checkpoint's dtype.
    """
    check_replay_verify_args(checkpoint, x, dt, B, C, A, D, start)
    L, H = x.shape[1], x.shape[2]
    cum = torch.cumsum(dt * A, dim=1)  # [b, L, H]
    rows = torch.arange(start, L, device=x.device)  # the record index each window position reads up to
    cum_w = cum[:, rows]  # [b, T, H]
    Bh, Ch = expand_groups(B, H), expand_groups(C, H)  # [b, L, H, N], [b, T, H, N]
    y = torch.exp(cum_w)[..., None] * torch.einsum("bhpn,bthn->bthp", checkpoint, Ch)  # checkpoint term
    scores = torch.einsum("bthn,bihn->bthi", Ch, Bh)  # C_s . B_i  [b, T, H, L]
    gap = cum_w[..., None] - cum.transpose(1, 2)[:, None]  # cum_w - cum_i  [b, T, H, L]
    causal = torch.arange(L, device=x.device)[None, :] <= rows[:, None]  # [T, L]
    decay = torch.exp(gap.masked_fill(~causal[None, :, None, :], -torch.inf))
    weights = scores * decay * dt.transpose(1, 2)[:, None]  # [b, T, H, L]
    y = y + torch.einsum("bthi,bihp->bthp", weights, x)  # record terms
    return y + D[:, None] * x[:, start:]


@dispatch("replay:replay_flush")
def replay_flush(checkpoint: Tensor, x: Tensor, dt: Tensor, B: Tensor, A: Tensor) -> Tensor:
    """Fold L records into the checkpoint: the state after them, written once.

    checkpoint [b, H, P, N]; x [b, L, H, P]; dt [b, L, H]; B [b, L, G, N]; A [H]
    returns S_L = exp(cum_L) S0 + sum_i exp(cum_L - cum_i) dt_i x_i B_i^T   [b, H, P, N]
    """
    check_replay_flush_args(checkpoint, x, dt, B, A)
    H = x.shape[2]
    cum = torch.cumsum(dt * A, dim=1)  # [b, L, H]
    if x.shape[1] == 0:
        return checkpoint.clone()
    total = cum[:, -1]  # [b, H]
    w = torch.exp(total[:, None] - cum) * dt  # [b, L, H]
    return (torch.exp(total)[..., None, None] * checkpoint
            + torch.einsum("bih,bihp,bihn->bhpn", w, x, expand_groups(B, H)))


# --------------------------------------------------------------------------------------------------
# Bytes moved
# --------------------------------------------------------------------------------------------------


@dataclass
class StepTraffic:
    """State bytes one call moved (per layer, summed over the batch)."""
    kind: str  # "verify", "commit", "flush", "prefill"
    tokens: int  # window length T (verify), tokens kept (commit), records folded (flush)
    read: int
    written: int


@dataclass
class Traffic:
    """Every state read and write of one layer store, in order (the notebook's timeline)."""
    events: list[StepTraffic] = field(default_factory=list)

    def add(self, kind: str, tokens: int, read: int, written: int) -> None:
        self.events.append(StepTraffic(kind, tokens, int(read), int(written)))

    @property
    def read(self) -> int:
        return sum(e.read for e in self.events if e.kind != "prefill")

    @property
    def written(self) -> int:
        return sum(e.written for e in self.events if e.kind != "prefill")

    @property
    def committed(self) -> int:
        return sum(e.tokens for e in self.events if e.kind == "commit")


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------------
# The two strategies
# --------------------------------------------------------------------------------------------------


class MambaLayerStore:
    """The interface both strategies implement, for one Mamba layer and a batch of sequences that
    advance together.

    extend(u [b, T, D]) -> out     T tokens, all kept (prefill; chunked scan)
    verify(u [b, T, D]) -> out     a window; its tokens stay pending until commit
    commit(n)                      keep the first n pending tokens (1 <= n <= T), drop the rest
    state() -> Mamba2State         the committed state (materialised for tests; not counted as traffic)
    traffic                        `Traffic`: bytes read / written by every call
    """

    def __init__(self, mixer: Mamba2Mixer, state: Mamba2State):
        self.mixer = mixer
        self.traffic = Traffic()
        self.pending = 0
        self._load(state)

    def _check_incoming(self, state: Mamba2State, batch_size: int | None = None) -> Mamba2State:
        where = f"{type(self).__name__} ({self.mixer.layer_name}), loaded state"
        check_state(state, self.mixer.config, batch_size=batch_size, name=where)
        want = state_dtype(state.conv.dtype)
        if state.ssm.dtype != want:
            raise Mamba2StateError(f"{where}: ssm dtype {state.ssm.dtype} does not go with conv dtype "
                                   f"{state.conv.dtype}; expected {want}")
        act = self.mixer.in_proj.weight.dtype
        if state.conv.dtype != act:
            raise Mamba2StateError(f"{where}: conv dtype {state.conv.dtype} != the mixer's activation dtype {act}")
        return state

    def _check_window(self, u: Tensor, fn: str) -> None:
        if self.pending:
            raise ValueError(f"{type(self).__name__}.{fn}: the last window ({self.pending} tokens) was not committed; "
                             "call commit(n) first")
        if u.dim() != 3 or u.shape[1] < 1:
            raise ValueError(f"{type(self).__name__}.{fn}: u must be [b, T>=1, D], got {tuple(u.shape)}")

    def _check_commit(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool):
            raise ValueError(f"{type(self).__name__}.commit: n must be an int, got {n!r}")
        if not 1 <= n <= self.pending:
            raise ValueError(f"{type(self).__name__}.commit({n}): only {self.pending} token(s) were verified; "
                             f"commit 1..{self.pending}" if self.pending else
                             f"{type(self).__name__}.commit({n}): nothing was verified since the last commit")

    @staticmethod
    def _conv_after(conv: Tensor, xbc: Tensor, n: int) -> Tensor:
        """The conv window after the first n tokens of xbc [b, T, C]: the last K-1 of conv ++ xbc[:n]."""
        window = torch.cat([conv, xbc[:, :n].transpose(1, 2).to(conv.dtype)], dim=-1)
        return window[..., window.shape[-1] - conv.shape[-1]:]


class PerPositionStates(MambaLayerStore):
    """Per-position states: a verify window writes the state after each of its T positions."""

    def _load(self, state: Mamba2State) -> None:
        self.committed = self._check_incoming(state).clone()
        self.candidates: list[Mamba2State] = []

    def state(self) -> Mamba2State:
        return self.committed.clone()

    def extend(self, u: Tensor) -> Tensor:
        self._check_window(u, "extend")
        out, self.committed = self.mixer(u, self.committed)
        self.traffic.add("prefill", u.shape[1], 0, self.committed.nbytes())
        return out

    def verify(self, u: Tensor) -> Tensor:
        self._check_window(u, "verify")
        s = self.mixer.scan_inputs(u, self.committed)
        h, ys, self.candidates = self.committed.ssm, [], []
        for t in range(u.shape[1]):
            y, h = ssd_step(h, s.x[:, t], s.dt[:, t], s.A, s.B[:, t], s.C[:, t], s.D)
            ys.append(y)
            self.candidates.append(Mamba2State(conv=self._conv_after(self.committed.conv, s.xbc, t + 1), ssm=h))
        self.pending = u.shape[1]
        one = self.committed.nbytes()
        self.traffic.add("verify", self.pending, one, one * self.pending)
        return self.mixer.scan_output(torch.stack(ys, dim=1), s.z, u.dtype)

    def commit(self, n: int) -> None:
        self._check_commit(n)
        self.committed = check_state(self.candidates[n - 1], name=f"PerPositionStates ({self.mixer.layer_name})")
        self.candidates, self.pending = [], 0
        self.traffic.add("commit", n, 0, 0)


class CheckpointReplay(MambaLayerStore):
    """Checkpoint + replay: one checkpoint, a ring of `capacity` records, a counter.

    Records (per token): x [H, P], B [G, N], dt [H] (post-softplus) and the pre-conv column
    [conv_dim] that rebuilds the conv window on rollback. A verify window of T tokens needs
    `count + T <= capacity`; if not, the committed records are first folded into the checkpoint
    (flush). capacity = 1 is plain decoding: every token is folded before the next one.
    """

    def __init__(self, mixer: Mamba2Mixer, state: Mamba2State, capacity: int = 16):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"CheckpointReplay: capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        super().__init__(mixer, state)

    def _load(self, state: Mamba2State) -> None:
        state = self._check_incoming(state)
        cfg, b = self.mixer.config, state.batch_size
        sdt, dev = state.ssm.dtype, state.ssm.device
        self.checkpoint = state.ssm.clone()
        self.conv = state.conv.clone()
        L = self.capacity
        self.x = torch.zeros(b, L, cfg.num_heads, cfg.head_dim, dtype=sdt, device=dev)
        self.B = torch.zeros(b, L, cfg.n_groups, cfg.state_size, dtype=sdt, device=dev)
        self.dt = torch.zeros(b, L, cfg.num_heads, dtype=sdt, device=dev)
        self.xbc = torch.zeros(b, L, cfg.conv_dim, dtype=state.conv.dtype, device=dev)
        self.count = 0  # committed records since the checkpoint
        self.flushes = 0

    def _record_bytes(self, n: int) -> int:
        per = (_nbytes(self.x[:, 0]) + _nbytes(self.B[:, 0]) + _nbytes(self.dt[:, 0]) + _nbytes(self.xbc[:, 0]))
        return per * n

    def _replay_read_bytes(self, n: int) -> int:
        """Reading n records for replay needs x, B and dt (not the pre-conv column)."""
        return (_nbytes(self.x[:, 0]) + _nbytes(self.B[:, 0]) + _nbytes(self.dt[:, 0])) * n

    def state(self) -> Mamba2State:
        c = self.count
        ssm = replay_flush(self.checkpoint, self.x[:, :c], self.dt[:, :c], self.B[:, :c], self._A())
        return Mamba2State(conv=self.conv.clone(), ssm=ssm)

    def _A(self) -> Tensor:
        return -torch.exp(self.mixer.A_log.to(self.checkpoint.dtype))

    def flush(self) -> None:
        """Fold the committed records into the checkpoint (written once) and empty the ring."""
        c = self.count
        new = replay_flush(self.checkpoint, self.x[:, :c], self.dt[:, :c], self.B[:, :c], self._A())
        check_state(Mamba2State(conv=self.conv, ssm=new), name=f"CheckpointReplay ({self.mixer.layer_name}) flush")
        self.checkpoint, self.count = new, 0
        self.flushes += 1
        self.traffic.add("flush", c, _nbytes(new) + self._replay_read_bytes(c), _nbytes(new))

    def extend(self, u: Tensor) -> Tensor:
        self._check_window(u, "extend")
        if self.count:
            self.flush()
        out, st = self.mixer(u, Mamba2State(conv=self.conv, ssm=self.checkpoint))
        self.checkpoint, self.conv = st.ssm, st.conv
        self.traffic.add("prefill", u.shape[1], 0, st.nbytes())
        return out

    def verify(self, u: Tensor) -> Tensor:
        self._check_window(u, "verify")
        T = u.shape[1]
        if T > self.capacity:
            raise ValueError(f"CheckpointReplay: a window of {T} tokens does not fit a buffer of {self.capacity} "
                             f"records; use capacity >= {T} (the draft length + 1)")
        if self.count + T > self.capacity:
            self.flush()
        s = self.mixer.scan_inputs(u, Mamba2State(conv=self.conv, ssm=self.checkpoint))
        c = self.count
        self.x[:, c:c + T], self.B[:, c:c + T], self.dt[:, c:c + T] = s.x, s.B, s.dt
        self.xbc[:, c:c + T] = s.xbc.to(self.xbc.dtype)
        y = replay_verify(self.checkpoint, self.x[:, :c + T], self.dt[:, :c + T], self.B[:, :c + T], s.C, s.A, s.D, c)
        self.pending = T
        self.traffic.add("verify", T, _nbytes(self.checkpoint) + self._replay_read_bytes(c) + _nbytes(self.conv),
                         self._record_bytes(T))
        return self.mixer.scan_output(y, s.z, u.dtype)

    def commit(self, n: int) -> None:
        self._check_commit(n)
        c = self.count
        self.conv = self._conv_after(self.conv, self.xbc[:, c:c + self.pending], n)
        self.count += n  # rejected records stay where they are and are overwritten by the next window
        self.pending = 0
        self.traffic.add("commit", n, 0, 0)


STRATEGIES = {"per-position": PerPositionStates, "replay": CheckpointReplay}


def make_store(strategy: str, mixer: Mamba2Mixer, state: Mamba2State, capacity: int = 16) -> MambaLayerStore:
    """A store by name: "per-position" or "replay" (with a ring of `capacity` records)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown Mamba state strategy {strategy!r}: expected one of {sorted(STRATEGIES)}")
    if strategy == "replay":
        return CheckpointReplay(mixer, state, capacity)
    return PerPositionStates(mixer, state)
