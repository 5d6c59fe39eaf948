"""The chunked SSD scan of Mamba-2 as a pipeline of four Triton kernels.

Kernel for `minispec.ssm.ssd.ssd_chunked`, same signature and the reference's own argument checks:
x [b, T, H, P], dt [b, T, H], A [H], B, C [b, T, G, N], D [H] or None, initial_state [b, H, P, N] or
None -> (y [b, T, H, P], final state [b, H, P, N]). Head h reads the B and C of group h // (H/G).

The T tokens are cut into chunks of Q = chunk_size (the last one may be shorter). Every kernel but the
second runs one program per (chunk, sequence, head) and works on one chunk; each recomputes its chunk's
log-decays l_s = dt_s A and their inclusive prefix sum cum_t = l_0 + ... + l_t from dt (Q numbers, cheaper
than a round trip through memory). In the order they run:

1. `_chunk_state_kernel`          the state each chunk builds from zero, in the chunk:
                                      S_c = sum_s exp(cum_end - cum_s) dt_s x_s B_s^T              [P, N]
2. `_state_passing_kernel`        one program per (sequence, head) walks the chunks in order: the
                                  state entering chunk c+1 is h_{c+1} = exp(cum_end of c) h_c + S_c,
                                  from h_0 = initial_state; the last one is the final state.
3. `_chunk_local_output_kernel`   the "diagonal block", a masked attention inside the chunk:
                                      y_t = sum_{s <= t} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s   [Q, P]
4. `_chunk_output_kernel`         the final output: y_t += exp(cum_t) (h_c C_t) + D x_t, with h_c the
                                  state entering t's chunk.

Kernels 1 and 3 are independent of each other and of the states; only kernel 2 is a recurrence, over
T / Q chunks instead of T tokens (as in state-spaces/mamba's `mamba_ssm/ops/triton/ssd_*.py`, whose
split into chunk cumsum, chunk state, state passing, chunk scan this follows).

Exponents are <= 0 wherever they are taken (A < 0, dt > 0; masked entries become -inf before exp).
Numerics: float32 throughout. The wrapper widens float16/bfloat16 inputs to float32 and returns y and
the state in the input's dtype; float64 is refused (the reference computes float64 in float64; this
would round it). The products are `tl.dot` with input_precision="tf32x3": three TF32 tensor-core products that
recover float32 accuracy (plain TF32 keeps 10 mantissa bits and drifts by about 1e-3; "ieee" float32
dots run on the CUDA cores and compile for minutes at these tiles). Under the interpreter they are
float32 matmuls. Against the float32 reference the differences are those of summation order and of
exp(cum_t - cum_s) (a difference of two prefix sums here, a sum of the log-decays between s and t
there): within 1e-5 of the output's scale at the sizes of tests/test_ssd_kernel.py.

Tiles: one program holds its whole chunk, [Q, P], [Q, N] and [Q, Q], padded to powers of two of at
least 16 (tl.dot's minimum). At lightning-mini's sizes (Q = 64, P = N = 32) that is up to 255
registers per thread and no spill (docs/kernels.md). Super's (Q = 128, P = 64, N = 128) compile as well
(255 registers per thread, no spill, on sm_90, measured here) but take minutes per arch on a CPU, so the
ahead-of-time grid stops at lightning-mini; a production kernel would tile P and N inside a chunk, as
mamba_ssm does.
"""
import torch
import triton
import triton.language as tl

from minispec.ssm.ssd import check_ssd_chunked_args


@triton.jit
def _chunk_log_decays(dt_ptr, a_ptr, rows, valid, h, H):
    """dt [BQ] of one chunk's tokens (0 where not valid) and cum [BQ], the inclusive prefix sums of dt A.

    rows [BQ]: the tokens' row b * T + t in the [b, T] layout. Invalid tokens add l = 0, so
    cum[-1] (and every cum past the last valid token) is the chunk's total log-decay.
    """
    dt = tl.load(dt_ptr + rows * H + h, mask=valid, other=0.0)
    return dt, tl.cumsum(dt * tl.load(a_ptr + h), axis=0)


@triton.jit
def _chunk_tokens(T, Q, BLOCK_Q: tl.constexpr):
    """The rows b * T + t [BQ] (int64) of the program's chunk, and which of them are tokens."""
    c = tl.program_id(0)
    seq = tl.program_id(1)
    t = c * Q + tl.arange(0, BLOCK_Q)
    valid = (tl.arange(0, BLOCK_Q) < Q) & (t < T)
    return seq.to(tl.int64) * T + t, valid


@triton.jit
def _chunk_state_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, states_ptr, T, Q, H, G, P, N,
                        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """1. S_c = sum_s exp(cum_end - cum_s) dt_s x_s B_s^T, the state chunk c builds from zero. Grid (chunks, b, H)."""
    h = tl.program_id(2)
    g = h // (H // G)
    rows, valid = _chunk_tokens(T, Q, BLOCK_Q)
    rp, rn = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    dt, cum = _chunk_log_decays(dt_ptr, a_ptr, rows, valid, h, H)
    to_end = tl.where(valid, tl.exp(tl.sum(dt * tl.load(a_ptr + h), axis=0) - cum), 0.0)  # [BQ]
    x = tl.load(x_ptr + (rows[:, None] * H + h) * P + rp[None, :], mask=valid[:, None] & (rp < P)[None, :], other=0.0)
    B = tl.load(b_ptr + (rows[:, None] * G + g) * N + rn[None, :], mask=valid[:, None] & (rn < N)[None, :], other=0.0)
    S = tl.dot(tl.trans(x * (to_end * dt)[:, None]), B, input_precision="tf32x3")  # [BP, BN]
    chunk = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    offs = ((chunk * H + h) * P + rp[:, None]) * N + rn[None, :]
    tl.store(states_ptr + offs, S, mask=(rp < P)[:, None] & (rn < N)[None, :])


@triton.jit
def _state_passing_kernel(states_ptr, dt_ptr, a_ptr, h0_ptr, entering_ptr, final_ptr, T, Q, n_chunks, H, P, N,
                          BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """2. h_{c+1} = exp(total log-decay of chunk c) h_c + S_c, chunk after chunk. Grid (b, H).

    Stores every entering state h_c [b, chunks, H, P, N] and the final state [b, H, P, N].
    """
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rp, rn, rq = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_Q)
    mask = (rp < P)[:, None] & (rn < N)[None, :]
    head = rp[:, None] * N + rn[None, :]  # [BP, BN] offsets inside one head's state
    state = tl.load(h0_ptr + (seq * H + h) * P * N + head, mask=mask, other=0.0)
    A = tl.load(a_ptr + h)
    for c in range(0, n_chunks):
        chunk = (seq * n_chunks + c) * H + h
        tl.store(entering_ptr + chunk * P * N + head, state, mask=mask)
        t = c * Q + rq
        dt = tl.load(dt_ptr + (seq * T + t) * H + h, mask=(rq < Q) & (t < T), other=0.0)
        S_c = tl.load(states_ptr + chunk * P * N + head, mask=mask, other=0.0)
        state = tl.exp(tl.sum(dt * A, axis=0)) * state + S_c
    tl.store(final_ptr + (seq * H + h) * P * N + head, state, mask=mask)


@triton.jit
def _chunk_local_output_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, y_ptr, T, Q, H, G, P, N,
                               BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """3. y_t = sum_{s <= t} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s inside the chunk. Grid (chunks, b, H)."""
    h = tl.program_id(2)
    g = h // (H // G)
    rows, valid = _chunk_tokens(T, Q, BLOCK_Q)
    rp, rn, rq = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_Q)
    dt, cum = _chunk_log_decays(dt_ptr, a_ptr, rows, valid, h, H)
    mask_qn = valid[:, None] & (rn < N)[None, :]
    B = tl.load(b_ptr + (rows[:, None] * G + g) * N + rn[None, :], mask=mask_qn, other=0.0)  # [BQ, BN]
    C = tl.load(c_ptr + (rows[:, None] * G + g) * N + rn[None, :], mask=mask_qn, other=0.0)
    scores = tl.dot(C, tl.trans(B), input_precision="tf32x3")  # [t, s] = C_t . B_s
    causal = (rq[None, :] <= rq[:, None]) & valid[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))  # exp(segsum)[t, s]
    mask_qp = valid[:, None] & (rp < P)[None, :]
    x = tl.load(x_ptr + (rows[:, None] * H + h) * P + rp[None, :], mask=mask_qp, other=0.0)  # [BQ, BP]
    y = tl.dot(scores * decay * dt[None, :], x, input_precision="tf32x3")  # [BQ, BP]
    tl.store(y_ptr + (rows[:, None] * H + h) * P + rp[None, :], y, mask=mask_qp)


@triton.jit
def _chunk_output_kernel(x_ptr, dt_ptr, a_ptr, c_ptr, d_ptr, entering_ptr, y_ptr, T, Q, H, G, P, N,
                         BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """4. y_t += exp(cum_t) (h_c C_t) + D x_t, h_c the state entering the chunk; y holds kernel 3's output.
    Grid (chunks, b, H)."""
    h = tl.program_id(2)
    g = h // (H // G)
    rows, valid = _chunk_tokens(T, Q, BLOCK_Q)
    rp, rn = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    _, cum = _chunk_log_decays(dt_ptr, a_ptr, rows, valid, h, H)
    C = tl.load(c_ptr + (rows[:, None] * G + g) * N + rn[None, :], mask=valid[:, None] & (rn < N)[None, :],
                other=0.0)  # [BQ, BN]
    chunk = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    h_c = tl.load(entering_ptr + ((chunk * H + h) * P + rp[:, None]) * N + rn[None, :],
                  mask=(rp < P)[:, None] & (rn < N)[None, :], other=0.0)  # [BP, BN]
    from_state = tl.dot(C, tl.trans(h_c), input_precision="tf32x3") * tl.exp(cum)[:, None]  # [BQ, BP]
    mask_qp = valid[:, None] & (rp < P)[None, :]
    offs = (rows[:, None] * H + h) * P + rp[None, :]
    x = tl.load(x_ptr + offs, mask=mask_qp, other=0.0)
    y = tl.load(y_ptr + offs, mask=mask_qp, other=0.0) + from_state + tl.load(d_ptr + h) * x
    tl.store(y_ptr + offs, y, mask=mask_qp)


def _block(n: int) -> int:
    """A power-of-two tile of at least 16 (tl.dot's minimum) that holds n."""
    return max(16, triton.next_power_of_2(n))


def ssd_stages(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
               chunk_size: int = 128, keep_y_local: bool = False) -> dict[str, torch.Tensor]:
    """The four kernels in order, and what each one wrote (float32; `ssd_chunked` keeps y and the final state).
    Kernel 4 adds into kernel 3's output in place; keep_y_local copies that output first (for a picture).

    chunk_states    [b, chunks, H, P, N]  kernel 1: the state each chunk builds from zero
    entering_states [b, chunks, H, P, N]  kernel 2: the state entering each chunk (the first is initial_state)
    final_state     [b, H, P, N]          kernel 2: the state after the last chunk
    y_local         [b, T, H, P]          kernel 3: the intra-chunk part of y (only with keep_y_local)
    y               [b, T, H, P]          kernel 4: y_local + the entering state's part + D x
    """
    check_ssd_chunked_args(x, dt, A, B, C, D, initial_state, chunk_size)
    if x.dtype == torch.float64:
        raise ValueError("the ssd_chunked kernel computes in float32 and would round float64 inputs: run float64 "
                         "with the reference (MINISPEC_BACKEND=torch)")
    b, T, H, P = x.shape
    G, N = B.shape[-2:]
    x32, dt32, A32, B32, C32 = (t.contiguous().float() for t in (x, dt, A, B, C))
    D32 = torch.zeros(H, device=x.device) if D is None else D.contiguous().float()
    h0 = (torch.zeros(b, H, P, N, device=x.device) if initial_state is None
          else initial_state.contiguous().float())
    n_chunks = triton.cdiv(T, chunk_size)
    states = torch.empty(b, n_chunks, H, P, N, device=x.device)
    entering = torch.empty_like(states)
    final = torch.empty(b, H, P, N, device=x.device)
    y = torch.empty(b, T, H, P, device=x.device)
    blocks = {"BLOCK_Q": _block(chunk_size), "BLOCK_P": _block(P), "BLOCK_N": _block(N)}
    per_chunk = (n_chunks, b, H)
    if n_chunks:
        _chunk_state_kernel[per_chunk](x32, dt32, A32, B32, states, T, chunk_size, H, G, P, N, **blocks)
    _state_passing_kernel[(b, H)](states, dt32, A32, h0, entering, final, T, chunk_size, n_chunks, H, P, N,
                                  **blocks)
    if n_chunks:
        _chunk_local_output_kernel[per_chunk](x32, dt32, A32, B32, C32, y, T, chunk_size, H, G, P, N, **blocks)
    stages = {"chunk_states": states, "entering_states": entering, "final_state": final, "y": y}
    if keep_y_local:
        stages["y_local"] = y.clone()
    if n_chunks:
        _chunk_output_kernel[per_chunk](x32, dt32, A32, C32, D32, entering, y, T, chunk_size, H, G, P, N, **blocks)
    return stages


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                chunk_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `minispec.ssm.ssd.ssd_chunked` (same arguments, same result in float32)."""
    stages = ssd_stages(x, dt, A, B, C, D, initial_state, chunk_size)
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    return stages["y"].to(x.dtype), stages["final_state"].to(state_dtype)
