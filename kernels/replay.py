"""Checkpoint + replay for Mamba-2 in two Triton kernels: verify (outputs, no state written) and flush.

Kernels for `minispec.ssm.replay.replay_verify` and `replay_flush`, with the same signatures; the
argument checks are the reference's own (`check_replay_verify_args`, `check_replay_flush_args`).
One program owns one (sequence b, head h); head h reads B/C group h // (H/G). Per program:

verify  the L = start + T records' log-decays l_i = dt_i A_h are loaded once and prefix-summed
        (cum); the window's C [T, N] and the checkpoint S0 [P, N] give the checkpoint term
        exp(cum_w) (S0 C_s), summed one state column at a time; then one pass over the records adds
        (C_s . B_i) dt_i exp(cum_w - cum_i) x_i for every window row s with i <= start + s (the causal
        mask over the window), and D x_s. Nothing but y is stored: this is the step that keeps the
        state read-only.
flush   one pass over the records: S = exp(cum_L) S0 + sum_i exp(cum_L - cum_i) dt_i x_i B_i^T,
        stored once.

Exponents are always <= 0 (masked entries are set to -inf before exp), so nothing overflows.
Numerics: float32 throughout (inputs are widened; the result is cast back to the checkpoint's
dtype). The products are elementwise multiply + sum rather than tl.dot: exact float32 on CPU under
the interpreter, and no tile-size minimum of 16 for the small T of a verify window.
"""
import torch
import triton
import triton.language as tl

from minispec.ssm.replay import check_replay_flush_args, check_replay_verify_args


@triton.jit
def _replay_verify_kernel(
    s0_ptr, x_ptr, dt_ptr, b_ptr, c_ptr, a_ptr, d_ptr, y_ptr,
    L, T, start, H, G, P, N,
    BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // (H // G)
    ri = tl.arange(0, BLOCK_L)
    rs = tl.arange(0, BLOCK_T)
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    A = tl.load(a_ptr + h)
    dt = tl.load(dt_ptr + (b * L + ri) * H + h, mask=ri < L, other=0.0)  # [BL]
    cum = tl.cumsum(dt * A, axis=0)  # [BL]
    rows = start + rs  # the record each window row reads up to
    cum_w = tl.sum(tl.where(ri[None, :] == rows[:, None], cum[None, :], 0.0), axis=1)  # [BT]

    # Checkpoint term S0 C_s, one state column n at a time: a [BT, BP, BN] product in registers would
    # need 64K floats per program at Super's heads (T = 8, P = 64, N = 128), far past the register file.
    y = tl.zeros([BLOCK_T, BLOCK_P], tl.float32)
    for n in range(0, N):
        C_n = tl.load(c_ptr + ((b * T + rs) * G + g) * N + n, mask=rs < T, other=0.0)  # [BT]
        S0_n = tl.load(s0_ptr + ((b * H + h) * P + rp) * N + n, mask=rp < P, other=0.0)  # [BP]
        y += C_n[:, None] * S0_n[None, :]
    y = y * tl.exp(cum_w)[:, None]  # [BT, BP]

    mask_tn = (rs[:, None] < T) & (rn[None, :] < N)
    C = tl.load(c_ptr + ((b * T + rs[:, None]) * G + g) * N + rn[None, :], mask=mask_tn, other=0.0)  # [BT, BN]

    for i in range(0, L):
        x_i = tl.load(x_ptr + ((b * L + i) * H + h) * P + rp, mask=rp < P, other=0.0)  # [BP]
        B_i = tl.load(b_ptr + ((b * L + i) * G + g) * N + rn, mask=rn < N, other=0.0)  # [BN]
        dt_i = tl.load(dt_ptr + (b * L + i) * H + h)
        cum_i = tl.sum(tl.where(ri == i, cum, 0.0), axis=0)
        score = tl.sum(C * B_i[None, :], axis=1)  # C_s . B_i  [BT]
        gap = tl.where(i <= rows, cum_w - cum_i, float("-inf"))
        w = score * tl.exp(gap) * dt_i  # [BT]
        y += w[:, None] * x_i[None, :]

    mask_tp = (rs[:, None] < T) & (rp[None, :] < P)
    x_win = tl.load(x_ptr + ((b * L + rows[:, None]) * H + h) * P + rp[None, :], mask=mask_tp, other=0.0)
    y += tl.load(d_ptr + h) * x_win
    tl.store(y_ptr + ((b * T + rs[:, None]) * H + h) * P + rp[None, :], y, mask=mask_tp)


@triton.jit
def _replay_flush_kernel(
    s0_ptr, x_ptr, dt_ptr, b_ptr, a_ptr, out_ptr,
    L, H, G, P, N,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // (H // G)
    ri = tl.arange(0, BLOCK_L)
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    A = tl.load(a_ptr + h)
    dt = tl.load(dt_ptr + (b * L + ri) * H + h, mask=ri < L, other=0.0)
    cum = tl.cumsum(dt * A, axis=0)
    total = tl.sum(dt * A, axis=0)
    mask_pn = (rp[:, None] < P) & (rn[None, :] < N)
    offs = ((b * H + h) * P + rp[:, None]) * N + rn[None, :]
    S = tl.load(s0_ptr + offs, mask=mask_pn, other=0.0) * tl.exp(total)
    for i in range(0, L):
        x_i = tl.load(x_ptr + ((b * L + i) * H + h) * P + rp, mask=rp < P, other=0.0)
        B_i = tl.load(b_ptr + ((b * L + i) * G + g) * N + rn, mask=rn < N, other=0.0)
        dt_i = tl.load(dt_ptr + (b * L + i) * H + h)
        cum_i = tl.sum(tl.where(ri == i, cum, 0.0), axis=0)
        S += (tl.exp(total - cum_i) * dt_i) * x_i[:, None] * B_i[None, :]
    tl.store(out_ptr + offs, S, mask=mask_pn)


def _f32(*tensors):
    return [t.contiguous().to(torch.float32) for t in tensors]


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(max(1, n)))


def replay_verify(checkpoint: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  A: torch.Tensor, D: torch.Tensor, start: int) -> torch.Tensor:
    """Triton twin of `minispec.ssm.replay.replay_verify` (same arguments, same result)."""
    check_replay_verify_args(checkpoint, x, dt, B, C, A, D, start)
    b, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    T = L - start
    s0, x32, dt32, B32, C32, A32, D32 = _f32(checkpoint, x, dt, B, C, A, D)
    y = torch.empty(b, T, H, P, dtype=torch.float32, device=x.device)
    _replay_verify_kernel[(b, H)](
        s0, x32, dt32, B32, C32, A32, D32, y, L, T, start, H, G, P, N,
        BLOCK_L=_pow2(L), BLOCK_T=_pow2(T), BLOCK_P=_pow2(P), BLOCK_N=_pow2(N),
    )
    return y.to(checkpoint.dtype)


def replay_flush(checkpoint: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                 A: torch.Tensor) -> torch.Tensor:
    """Triton twin of `minispec.ssm.replay.replay_flush` (same arguments, same result)."""
    check_replay_flush_args(checkpoint, x, dt, B, A)
    b, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if L == 0:
        return checkpoint.clone()
    s0, x32, dt32, B32, A32 = _f32(checkpoint, x, dt, B, A)
    out = torch.empty_like(s0)
    _replay_flush_kernel[(b, H)](
        s0, x32, dt32, B32, A32, out, L, H, G, P, N,
        BLOCK_L=_pow2(L), BLOCK_P=_pow2(P), BLOCK_N=_pow2(N),
    )
    return out.to(checkpoint.dtype)
