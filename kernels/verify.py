"""Exact speculative verification in one Triton kernel: one program per row of the batch.

Kernel for `minispec.speculative.verify.verify`, with the same signature; given the same uniforms it accepts
the same drafts and emits the same tokens.

A program walks its row's drafts in order, reading only p_k(x_k) and q_k(x_k), two numbers per draft,
until the first rejection. Only then does it touch a whole vocabulary row, once, at the position
where the next token is drawn (the residual after a rejection, or the bonus distribution), in
BLOCK_V-wide chunks so that any V (262,144 included) fits:

    pass 1: the mass of the distribution (its normaliser);
    pass 2: a running CDF, tl.cumsum per chunk plus the carry from earlier chunks, counting the
            tokens whose CDF is still below u * mass; that count is the inverse-CDF index.

Sums are taken in float64, as in the reference, so that a chunked scan and torch's sequential
cumsum land on the same token (see `inverse_cdf` in the reference).
"""
import torch
import triton
import triton.language as tl

from minispec.speculative.verify import PAD, VerifyResult, prepare_verify_args

MAX_BLOCK_V = 2048


@triton.jit
def _next_token_dist(p_row, q_row, x, v, V, subtract_q, HAS_Q: tl.constexpr):
    """Columns v of max(p - q, 0) when subtract_q, else of p. Columns past V read as 0.

    Without draft probabilities q is one-hot at the draft x: then p - q is p with 1 taken off p(x),
    computed exactly as the reference computes p - one_hot(x).
    """
    p = tl.load(p_row + v, mask=v < V, other=0.0)
    if HAS_Q:
        # (Not `(v < V) & subtract_q`: the triton 3.9 interpreter broadcasts a scalar bool to an
        # int32 block, which it then refuses as a mask.)
        q = tl.load(q_row + v, mask=tl.where(subtract_q, v < V, False), other=0.0)
    else:
        q = tl.where(v == x, 1.0, 0.0)
    return tl.maximum(p - tl.where(subtract_q, q, 0.0), 0.0)


@triton.jit
def _verify_kernel(draft_ptr, p_ptr, q_ptr, u_ptr, lengths_ptr,  # inputs
                   tokens_ptr, accepted_ptr, emitted_ptr,  # outputs
                   K, V, eos,
                   HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # int64: b * (K+1) * V overflows int32 at large B and V
    K_b = tl.load(lengths_ptr + b)
    drafts = draft_ptr + b * K
    u_row = u_ptr + b * (K + 1)
    out = tokens_ptr + b * (K + 1)
    p_rows = p_ptr + b * (K + 1) * V  # p_k of this row starts at p_rows + k * V
    q_rows = q_ptr + b * K * V

    # 1. Walk the drafts in order. No `break` in Triton: after the first rejection (or past K_b)
    #    `running` is False, and the masked loads and stores below do nothing.
    accepted = tl.zeros([], tl.int32)
    emitted = tl.zeros([], tl.int32)
    running = tl.full([], True, tl.int1)  # drafts 0..k-1 all accepted
    before_eos = tl.full([], True, tl.int1)  # no EOS among the tokens emitted so far
    for k in range(K):
        live = running & (k < K_b)
        x = tl.load(drafts + k, mask=live, other=0)
        p_x = tl.load(p_rows + k * V + x, mask=live, other=0.0)
        if HAS_Q:
            q_x = tl.load(q_rows + k * V + x, mask=live, other=1.0)
        else:
            q_x = 1.0
        u = tl.load(u_row + k, mask=live, other=1.0)
        accept = live & (u * q_x <= p_x)  # u <= min(1, p/q) without dividing by q
        tl.store(out + k, x, mask=accept)
        accepted += accept.to(tl.int32)
        emitted += (accept & before_eos).to(tl.int32)
        before_eos = before_eos & ~(accept & (x == eos))
        running = accept

    # 2. The next token is drawn at position `accepted`: from the residual if draft `accepted` was
    #    rejected there, from p_{K_b} (the bonus) if every draft was accepted.
    rejected = accepted < K_b
    p_row = p_rows + accepted * V
    q_row = q_rows + tl.minimum(accepted, K - 1) * V
    x = tl.load(drafts + accepted, mask=rejected, other=-1)

    # Pass 1: the residual's mass and, in case rounding left the residual empty, p's mass.
    residual_mass = tl.zeros([], tl.float64)
    p_mass = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        residual = _next_token_dist(p_row, q_row, x, v, V, rejected, HAS_Q)
        residual_mass += tl.sum(residual.to(tl.float64), axis=0)
        p_mass += tl.sum(tl.load(p_row + v, mask=v < V, other=0.0).to(tl.float64), axis=0)
    subtract_q = rejected & (residual_mass > 0)
    mass = tl.where(residual_mass > 0, residual_mass, p_mass)

    # Pass 2: inverse CDF. The index of the first token with cdf >= u * mass is the number of tokens
    # whose cdf is below it.
    threshold = tl.load(u_row + K).to(tl.float64) * mass
    below = tl.zeros([], tl.int32)
    last_nonzero = tl.full([], -1, tl.int32)
    carry = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        dist = _next_token_dist(p_row, q_row, x, v, V, subtract_q, HAS_Q)
        cdf = carry + tl.cumsum(dist.to(tl.float64), axis=0)
        below += tl.sum(((cdf < threshold) & (v < V)).to(tl.int32), axis=0)
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(dist > 0, v, -1), axis=0))
        carry += tl.sum(dist.to(tl.float64), axis=0)
    # With u = 1 the threshold is the whole mass, which the scan may miss by a rounding error:
    # then every token is "below", and the answer is the last token that has any mass.
    token = tl.minimum(below, last_nonzero)

    tl.store(out + accepted, token)
    tl.store(accepted_ptr + b, accepted)
    tl.store(emitted_ptr + b, emitted + before_eos.to(tl.int32))


def verify(draft_tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
           uniforms: torch.Tensor | None = None, draft_lengths: torch.Tensor | None = None,
           eos_token_id: int | None = None, generator: torch.Generator | None = None) -> VerifyResult:
    """Same arguments and result as the reference `minispec.speculative.verify.verify`."""
    x, p, q, u, K_b = prepare_verify_args(draft_tokens, target_probs, draft_probs, uniforms, draft_lengths,
                                          generator)
    B, K = x.shape
    V = p.shape[-1]
    tokens = torch.full((B, K + 1), PAD, dtype=torch.long, device=p.device)
    accepted = torch.empty(B, dtype=torch.long, device=p.device)
    num_emitted = torch.empty(B, dtype=torch.long, device=p.device)
    _verify_kernel[(B,)](
        x.contiguous(), p.contiguous(), p if q is None else q.contiguous(), u.contiguous(),
        K_b.contiguous(), tokens, accepted, num_emitted,
        K, V, -1 if eos_token_id is None else eos_token_id,  # -1: no draft id equals it
        HAS_Q=q is not None, BLOCK_V=min(triton.next_power_of_2(V), MAX_BLOCK_V),
    )
    return VerifyResult(accepted, tokens, num_emitted, accepted == K_b)
