"""The SSD math of Mamba-2 (Dao & Gu 2024, "Transformers are SSMs"), as plain functions on tensors.

Notation, per layer:

    b  batch        T  tokens       H  heads        P  head_dim       N  state_size
    G  groups (head h reads the B and C of group h // (H/G): `expand_groups`)
    Q  chunk_size   K  conv_kernel

The SSM of one head has a scalar decay; its state h is a P x N matrix. Per token:

    dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit);  A = -exp(A_log);  a = exp(dt * A)   [discretize]
    h  = a * h + dt * x B^T                                                                        [ssd_step]
    y  = h C + D * x

The same map over T tokens is computed either token by token (`ssd_sequential`, the spec) or by the
chunked SSD scan (`ssd_chunked`, section 6 of the paper): inside a chunk a masked "attention-like"
quadratic form with the segment-sum decay matrix (`segsum`), across chunks a recurrence on the states.

Around the scan sit the two other pieces of the Mamba-2 block: a depthwise causal conv over x, B and C
(`causal_conv1d`, continuing from a rolling window) and the gated RMSNorm in front of the output
projection (`gated_rms_norm`). `minispec.ssm.mamba2.Mamba2Mixer` wires them into one layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from minispec.backend import dispatch

__all__ = [
    "discretize",
    "expand_groups",
    "ssd_step",
    "ssd_sequential",
    "segsum",
    "check_ssd_chunked_args",
    "ssd_chunked",
    "causal_conv1d",
    "gated_rms_norm",
]


def discretize(
    dt_raw: Tensor, dt_bias: Tensor, A_log: Tensor, time_step_limit: tuple[float, float] = (0.0, math.inf)
) -> tuple[Tensor, Tensor]:
    """Zero-order-hold discretisation of the scalar-per-head SSM.

    dt_raw: [..., H] (from in_proj), dt_bias: [H], A_log: [H]
    returns dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit)  [..., H]   (the step size, > 0)
            A  = -exp(A_log)                                          [H]        (< 0)
    The per-token decay of head h is a = exp(dt * A) in (0, 1); `ssd_step` and `ssd_chunked` use
    dt * A (the log-decay) and dt * x B^T (the input). Softplus passes values above 20 through.
    Computed in the dtype of dt_raw (upcast it first to run in float32/float64).
    """
    if not dt_raw.shape[-1] == dt_bias.shape[-1] == A_log.shape[-1]:
        raise ValueError(
            f"discretize: dt_raw [..., {dt_raw.shape[-1]}], dt_bias {tuple(dt_bias.shape)} "
            f"and A_log {tuple(A_log.shape)} must share H"
        )
    dt = F.softplus(dt_raw + dt_bias.to(dt_raw.dtype))
    lo, hi = time_step_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    A = -torch.exp(A_log.to(dt_raw.dtype))
    return dt, A


def expand_groups(BC: Tensor, num_heads: int) -> Tensor:
    """B or C per head: [..., G, N] -> [..., H, N], head h reading group h // (H/G)."""
    return BC.repeat_interleave(num_heads // BC.shape[-2], dim=-2)


def _check_ssd_shapes(fn: str, x, dt, A, B, C, D, h0, lead: int) -> None:
    """Shape checks shared by the ssd_* functions; lead = 1 for [b, ...] (one token), 2 for [b, T, ...]."""
    layout = "[b, T, H, P]" if lead == 2 else "[b, H, P]"
    if x.dim() != lead + 2:
        raise ValueError(f"{fn}: x must be {layout}, got {tuple(x.shape)}")
    *bt, H, P = x.shape
    if tuple(dt.shape) != (*bt, H):
        raise ValueError(f"{fn}: dt has shape {tuple(dt.shape)}, expected {(*bt, H)}")
    if tuple(A.shape) != (H,):
        raise ValueError(f"{fn}: A has shape {tuple(A.shape)}, expected ({H},)")
    if B.dim() != lead + 2 or tuple(B.shape[:lead]) != tuple(bt):
        raise ValueError(f"{fn}: B has shape {tuple(B.shape)}, expected {(*bt, 'G', 'N')}")
    if tuple(C.shape) != tuple(B.shape):
        raise ValueError(f"{fn}: C {tuple(C.shape)} and B {tuple(B.shape)} must match")
    G, N = B.shape[-2:]
    if H % G:
        raise ValueError(f"{fn}: H = {H} heads is not a multiple of G = {G} groups")
    if D is not None and tuple(D.shape) != (H,):
        raise ValueError(f"{fn}: D has shape {tuple(D.shape)}, expected ({H},)")
    if h0 is not None and tuple(h0.shape) != (bt[0], H, P, N):
        raise ValueError(f"{fn}: state has shape {tuple(h0.shape)}, expected [b, H, P, N] = {(bt[0], H, P, N)}")


def ssd_step(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One token of the SSM recurrence (the spec every other form is tested against).

    state [b, H, P, N], x [b, H, P], dt [b, H], A [H], B, C [b, G, N], D [H] or None
    returns y [b, H, P] and the new state [b, H, P, N]:
        h_new = exp(dt * A) * h + dt * x B^T        (the decay applies to the old state only)
        y     = h_new C + D * x
    Nothing is modified in place.
    """
    _check_ssd_shapes("ssd_step", x, dt, A, B, C, D, state, lead=1)
    H = x.shape[1]
    Bh, Ch = expand_groups(B, H), expand_groups(C, H)  # [b, H, N]
    decay = torch.exp(dt * A)  # [b, H]
    new_state = decay[:, :, None, None] * state + (dt[:, :, None] * x)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        y = y + D[:, None] * x
    return y, new_state


def ssd_sequential(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The recurrence, one token at a time: a loop of `ssd_step`. The naive spec for the chunked scan.

    x [b, T, H, P], dt [b, T, H], A [H], B, C [b, T, G, N], D [H] or None, initial_state [b, H, P, N] or None (zeros)
    returns y [b, T, H, P] and the final state [b, H, P, N].
    """
    _check_ssd_shapes("ssd_sequential", x, dt, A, B, C, D, initial_state, lead=2)
    b, T, H, P = x.shape
    h = initial_state if initial_state is not None else x.new_zeros(b, H, P, B.shape[-1])
    ys = []
    for t in range(T):
        y_t, h = ssd_step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        ys.append(y_t)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)
    return y, h


def segsum(log_a: Tensor) -> Tensor:
    """Segment sums of log-decays: [..., Q] -> [..., Q, Q].

    out[..., t, s] = log_a[s+1] + ... + log_a[t]  for s <= t   (0 on the diagonal: an empty sum)
                   = -inf                          for s >  t   (so exp() gives the causal mask)
    exp(out[t, s]) is the decay a token s's contribution has accumulated by the time t is read:
    the decays of the tokens *after* s up to and including t, never s's own.
    Built as a cumulative sum down each column of a strictly-lower-triangular copy of log_a, so
    no two large cumulative sums are subtracted (the numerically careful form).
    """
    Q = log_a.shape[-1]
    rows = log_a[..., :, None].expand(*log_a.shape, Q)  # [..., t, s] = log_a[t]
    strictly_lower = torch.ones(Q, Q, dtype=torch.bool, device=log_a.device).tril(-1)
    out = rows.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)  # [t, s] = sum_{s < j <= t} log_a[j]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=log_a.device).tril()
    return out.masked_fill(~causal, -math.inf)


def check_ssd_chunked_args(x, dt, A, B, C, D, initial_state, chunk_size) -> None:
    """Raise ValueError unless the arguments of `ssd_chunked` fit together (its reference and its kernel share this)."""
    _check_ssd_shapes("ssd_chunked", x, dt, A, B, C, D, initial_state, lead=2)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"ssd_chunked: chunk_size must be a positive int, got {chunk_size!r}")


@dispatch("ssd:ssd_chunked")
def ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 128,
) -> tuple[Tensor, Tensor]:
    """The chunked SSD scan (Dao & Gu 2024, section 6): same inputs and outputs as `ssd_sequential`.

    x [b, T, H, P], dt [b, T, H], A [H], B, C [b, T, G, N], D [H] or None, initial_state [b, H, P, N] or None
    returns y [b, T, H, P] and the final state [b, H, P, N]. T need not be a multiple of chunk_size
    (the last chunk is simply shorter).

    For each chunk of Q tokens with log-decays l_s = dt_s * A and cum_t = l_0 + ... + l_t (inclusive),
    starting from the state h entering the chunk:

      1. intra-chunk, the "diagonal block" (a masked attention with scores C_t . B_s):
             y_t  = sum_{s <= t} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s        exp(segsum(l))[t, s]
      2. the entering state, read at t: it has decayed through tokens 0..t, t's own decay included:
             y_t += exp(cum_t) (h C_t)
      3. state passing to the next chunk: token s decays through s+1..Q-1 only (not its own l_s):
             h    = exp(cum_{Q-1}) h + sum_s exp(cum_{Q-1} - cum_s) dt_s x_s B_s^T
    and finally y += D * x. Steps 1, 2 are parallel over the chunk; step 3 is a recurrence over
    T/Q chunks instead of T tokens.

    Dispatched (minispec/backend.py): the Triton kernels of kernels/ssd.py split the same three steps
    into a pipeline of four (chunk states, state passing, chunk-local output, final output).
    """
    check_ssd_chunked_args(x, dt, A, B, C, D, initial_state, chunk_size)
    b, T, H, P = x.shape
    N = B.shape[-1]
    Bh, Ch = expand_groups(B, H), expand_groups(C, H)  # [b, T, H, N]
    xdt = x * dt[..., None]  # [b, T, H, P]   the input, scaled by its step size
    log_a = (dt * A).transpose(1, 2)  # [b, H, T]     log-decays, <= 0
    h = initial_state if initial_state is not None else x.new_zeros(b, H, P, N)
    ys = []
    for start in range(0, T, chunk_size):
        c = slice(start, min(start + chunk_size, T))
        xc, Bc, Cc, lc = xdt[:, c], Bh[:, c], Ch[:, c], log_a[:, :, c]  # [b,q,H,P] [b,q,H,N] [b,q,H,N] [b,H,q]
        cum = lc.cumsum(dim=-1)  # [b, H, q]
        # 1. intra-chunk quadratic form
        scores = torch.einsum("bthn,bshn->bhts", Cc, Bc)  # C_t . B_s
        y = torch.einsum("bhts,bshp->bthp", scores * torch.exp(segsum(lc)), xc)
        # 2. contribution of the state entering the chunk
        y = y + torch.einsum("bthn,bhpn->bthp", Cc, h) * torch.exp(cum).transpose(1, 2)[..., None]
        # 3. the state leaving the chunk
        to_end = torch.exp(cum[:, :, -1:] - cum)  # [b, H, q]
        h = torch.exp(cum[:, :, -1])[..., None, None] * h + torch.einsum("bhs,bshp,bshn->bhpn", to_end, xc, Bc)
        ys.append(y)
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)
    if D is not None:
        y = y + D[:, None] * x
    return y, h


def causal_conv1d(
    xBC: Tensor, weight: Tensor, bias: Tensor | None = None, conv_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution over time, continuing from a rolling window (no activation).

    xBC:        [b, T, C]      the new pre-conv inputs (channels last, as in_proj gives them)
    weight:     [C, K] or [C, 1, K] (nn.Conv1d's layout); tap k multiplies the input k - (K-1) steps back
    bias:       [C] or None
    conv_state: [b, C, K-1]    the K-1 inputs before xBC, oldest first; None means zeros (start of sequence)
    returns:    out [b, T, C]  out[t] = bias + sum_k weight[:, k] * window[t + k], window = state ++ xBC
                new_state [b, C, K-1]  the last K-1 columns of the window

    With T = 1 this is the per-token rolling update; over a whole prompt from a zero state it equals
    `F.conv1d(..., padding=K-1, groups=C)` cut to the first T outputs.
    """
    if weight.dim() == 3:
        if weight.shape[1] != 1:
            raise ValueError(f"causal_conv1d: weight {tuple(weight.shape)} is not depthwise [C, 1, K]")
        weight = weight[:, 0]
    if xBC.dim() != 3:
        raise ValueError(f"causal_conv1d: xBC must be [b, T, C], got {tuple(xBC.shape)}")
    b, T, C = xBC.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"causal_conv1d: weight {tuple(weight.shape)} does not match C = {C}")
    K = weight.shape[1]
    if conv_state is None:
        conv_state = xBC.new_zeros(b, C, K - 1)
    if tuple(conv_state.shape) != (b, C, K - 1):
        raise ValueError(
            f"causal_conv1d: conv_state has shape {tuple(conv_state.shape)}, expected [b, C, K-1] = {(b, C, K - 1)}"
        )
    window = torch.cat([conv_state.to(xBC.dtype), xBC.transpose(1, 2)], dim=-1)  # [b, C, K-1+T]
    out = sum(weight[:, k, None] * window[:, :, k : k + T] for k in range(K))  # [b, C, T]
    if bias is not None:
        out = out + bias[:, None]
    new_state = window[:, :, window.shape[-1] - (K - 1) :]
    return out.transpose(1, 2), new_state


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, group_size: int, eps: float = 1e-5) -> Tensor:
    """weight * RMSNorm(y * silu(z)), the RMS taken over each group of `group_size` channels separately.

    y, z: [..., d_inner], weight: [d_inner], group_size divides d_inner (Mamba-2 uses d_inner / G, so
    norm groups line up with the B/C groups). The gate comes *before* the norm (mamba_ssm's
    `norm_before_gate=False`, which NemotronH uses). Computed in float32 or wider; returns that dtype.
    """
    if y.shape != z.shape:
        raise ValueError(f"gated_rms_norm: y {tuple(y.shape)} and z {tuple(z.shape)} must match")
    d = y.shape[-1]
    if weight.shape != (d,) or d % group_size:
        raise ValueError(
            f"gated_rms_norm: weight {tuple(weight.shape)} / group_size {group_size} do not fit d_inner = {d}"
        )
    dtype = torch.promote_types(y.dtype, torch.float32)
    g = y.to(dtype) * F.silu(z.to(dtype))
    g = g.unflatten(-1, (d // group_size, group_size))
    g = g * torch.rsqrt(g.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight.to(dtype) * g.flatten(-2)
