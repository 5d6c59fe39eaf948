"""Exact speculative verification: accept a prefix of the drafts, then emit one token from the target.

Speculative sampling (Leviathan et al. 2022, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).
Notation: p is the target's distribution, q the drafter's. For drafts x_0 .. x_{K-1}, x_k ~ q_k:

    accept x_k with probability min(1, p_k(x_k) / q_k(x_k)), in order,
    at the first rejection emit a token from the residual  norm(max(p_k - q_k, 0))  and stop,
    if every draft is accepted emit a bonus token from p_K, the target's next distribution.

Every emitted token is then distributed exactly as the target's: P(emit x) = min(p, q)(x) from
acceptance plus (1 - sum min(p, q)) * norm(max(p - q, 0))(x) from the residual, and
1 - sum min(p, q) = sum max(p - q, 0), so the two add up to p(x).

p and q must be the distributions actually sampled from, after temperature / top-k / top-p
(minispec.speculative.sampling applies the same settings to target and drafter). A deterministic drafter
(argmax, n-gram) has a one-hot q: pass draft_probs=None. Greedy decoding needs no separate code path:
at temperature 0 p is one-hot at the target's argmax, so with one-hot q the rule below accepts a draft
iff it equals the target's argmax, and both the correction and the bonus are that argmax.

The Triton kernel beside this reference (kernels/verify.py) takes the same arguments and returns the
same tokens given the same uniforms; `MINISPEC_BACKEND` picks between them (minispec/backend.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minispec.backend import dispatch

PAD = -1  # fills the slots of `tokens` past the correction / bonus token
SUM_TOLERANCE = 1e-3  # how far a row of p or q may sum from 1


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [B] long, drafts accepted, 0..K_b
    tokens: torch.Tensor  # [B, K+1] long: the accepted drafts, then the correction or bonus token, then PAD
    num_emitted: torch.Tensor  # [B] long, accepted + 1, or fewer: cut just after the first EOS
    next_is_bonus: torch.Tensor  # [B] bool: every draft was accepted, so tokens[b, accepted] is a bonus


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(accept one draft x ~ q) = sum_x q(x) min(1, p(x)/q(x)) = sum_x min(p, q)(x) = 1 - TV(p, q).

    p, q: [..., V] distributions. Returns [...].
    """
    return torch.minimum(p, q).sum(dim=-1)


def draw_uniforms(batch: int, K: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """[B, K+1] uniforms in (0, 1]: one per draft, and one for the correction / bonus token."""
    # torch.rand is in [0, 1) and can return exactly 0. u = 0 would accept a draft the target gives
    # probability 0 (0 * q <= 0) and make the inverse CDF below able to pick a zero-probability
    # token, so use 1 - rand, which lies in (0, 1].
    return 1 - torch.rand(batch, K + 1, generator=generator, device=device)


def prepare_verify_args(draft_tokens, target_probs, draft_probs, uniforms, draft_lengths, generator):
    """Fill in the defaults, check everything, and bring p, q and u to float32, as the kernel reads them.

    Both the reference and the kernel start here, so they raise the same errors on the same input.
    Returns (draft_tokens, target_probs, draft_probs, uniforms, draft_lengths), ids as long.
    """
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    if draft_tokens.is_floating_point() or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must hold integer token ids, got dtype {draft_tokens.dtype}")
    B, K = draft_tokens.shape
    if K < 1:
        raise ValueError("empty drafts: draft_tokens has K = 0 columns; verify needs at least one draft")
    if draft_lengths is None:
        draft_lengths = torch.full((B,), K, device=draft_tokens.device)
    if uniforms is None:
        uniforms = draw_uniforms(B, K, generator, draft_tokens.device)
    target_probs = target_probs.float()
    draft_probs = None if draft_probs is None else draft_probs.float()
    uniforms = uniforms.float()
    check_verify_args(draft_tokens, target_probs, draft_probs, uniforms, draft_lengths)
    return draft_tokens.long(), target_probs, draft_probs, uniforms, draft_lengths.long()


def check_verify_args(draft_tokens, target_probs, draft_probs, uniforms, draft_lengths) -> None:
    """Raise ValueError naming what is wrong. Shapes as in `verify`; uniforms and draft_lengths given.

    Only the slots a row uses are checked (drafts k < K_b, target positions k <= K_b, uniforms k < K_b
    and the last column): the rest of a ragged row may hold padding such as -1.
    """
    B, K = draft_tokens.shape
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got shape {tuple(target_probs.shape)}")
    if target_probs.shape[0] != B:
        raise ValueError(f"batch size mismatch: draft_tokens has {B} rows, "
                         f"target_probs has {target_probs.shape[0]}")
    if target_probs.shape[1] != K + 1:
        raise ValueError(f"target_probs must hold K+1 = {K + 1} positions (one per draft, then the bonus), "
                         f"got {target_probs.shape[1]}")
    V = target_probs.shape[2]
    if draft_probs is not None:
        if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, K):
            raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, V], got {tuple(draft_probs.shape)}")
        if draft_probs.shape[2] != V:
            raise ValueError(f"vocab mismatch: target_probs has V = {V}, "
                             f"draft_probs has V = {draft_probs.shape[2]}")
    if draft_lengths.shape != (B,):
        raise ValueError(f"draft_lengths must be [B] = [{B}], got shape {tuple(draft_lengths.shape)}")
    if ((draft_lengths < 1) | (draft_lengths > K)).any():
        raise ValueError(f"draft_lengths must lie in [1, K] = [1, {K}], got {draft_lengths.tolist()}")
    if uniforms.shape != (B, K + 1):
        raise ValueError(f"uniforms must be [B, K+1] = [{B}, {K + 1}], got shape {tuple(uniforms.shape)}")

    k = torch.arange(K + 1, device=draft_tokens.device)
    draft_used = k[:K] < draft_lengths[:, None]  # [B, K]
    target_used = k <= draft_lengths[:, None]  # [B, K+1]: the draft positions, then the bonus
    u_used = F.pad(draft_used, (0, 1), value=True)  # the last column samples the correction / bonus
    u = uniforms[u_used]
    if u.isnan().any():
        raise ValueError("uniforms contain NaN")
    if ((u <= 0) | (u > 1)).any():
        raise ValueError("uniforms must lie in (0, 1]; u = 0 could accept a token the target never emits")
    _check_distribution("target_probs", target_probs[target_used])
    if draft_probs is not None:
        _check_distribution("draft_probs", draft_probs[draft_used])
    ids = draft_tokens[draft_used]
    bad = (ids < 0) | (ids >= V)
    if bad.any():
        raise ValueError(f"draft token ids must lie in [0, V) = [0, {V}), got {ids[bad][0].item()}")


def _check_distribution(name: str, rows: torch.Tensor) -> None:
    """rows: [N, V]; each must be a probability distribution."""
    if rows.isnan().any():
        raise ValueError(f"{name} contains NaN")
    if (rows < 0).any():
        raise ValueError(f"{name} is not a distribution: it has negative entries")
    sums = rows.sum(dim=-1, dtype=torch.float64)
    off = (sums - 1).abs() > SUM_TOLERANCE
    if off.any():
        raise ValueError(f"{name} is not a distribution: a row sums to {sums[off][0].item():.6g}, "
                         f"not 1 (tolerance {SUM_TOLERANCE})")


def inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index i with cumsum(dist)[i] >= u * sum(dist): a sample from dist / sum(dist).

    dist: [B, V] non-negative, unnormalised; u: [B] in (0, 1]. Returns [B] long.
    u > 0 means a token of zero mass is never chosen. The running sum is taken in float64 because
    the kernel sums in another order (a chunked scan): in float32 the two orders round differently
    enough to pick a different token in about 1 draw in 100 at V = 262,144; in float64 the rounding
    is far below any token's mass.
    """
    cdf = dist.double().cumsum(dim=-1)
    threshold = u.double() * cdf[:, -1]
    return (cdf < threshold[:, None]).sum(dim=-1)


@dispatch("verify:verify")
def verify(draft_tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
           uniforms: torch.Tensor | None = None, draft_lengths: torch.Tensor | None = None,
           eos_token_id: int | None = None, generator: torch.Generator | None = None) -> VerifyResult:
    """Accept a prefix of each row's drafts and emit the target's next token after it.

    draft_tokens:  [B, K] long, x_k, the drafts (row b uses its first K_b = draft_lengths[b]).
    target_probs:  [B, K+1, V], p_k: the target's distribution at each draft position, then the bonus
                   position. Row b's bonus comes from p_{K_b}.
    draft_probs:   [B, K, V], q_k, the distributions the drafts were sampled from; None for
                   deterministic (argmax) drafts, i.e. one-hot q.
    uniforms:      [B, K+1] in (0, 1]. Column k < K decides draft k; the last column samples the
                   correction / bonus token. None: drawn from `generator`.
    draft_lengths: [B] long in [1, K], K_b for ragged blocks; None: every row has K drafts.
    eos_token_id:  num_emitted stops just after the first EOS among the emitted tokens.

    Accept x_k iff u_k * q_k(x_k) <= p_k(x_k): that is u_k <= min(1, p/q), without dividing by q.
    Sampling is by inverse CDF (see `inverse_cdf`). If a rejection leaves a residual max(p - q, 0)
    with no mass at all, which exact arithmetic rules out (rejecting needs q(x) > p(x), so the mass
    of q - p > 0 somewhere must be repaid by p - q > 0 elsewhere) but p and q that sum to 1 only
    within rounding allow, the token is drawn from p instead.
    """
    x, p, q, u, K_b = prepare_verify_args(draft_tokens, target_probs, draft_probs, uniforms, draft_lengths,
                                          generator)
    B, K = x.shape
    rows = torch.arange(B, device=p.device)
    k = torch.arange(K, device=p.device)
    is_draft = k < K_b[:, None]  # [B, K]; the slots past K_b may hold padding, so read token 0 there
    x = x.masked_fill(~is_draft, 0)
    if q is None:
        q = F.one_hot(x, p.shape[-1]).float()

    # 1. Acceptance: the test of draft k only counts if drafts 0..k-1 were all accepted.
    p_x = p[:, :K].gather(-1, x[..., None]).squeeze(-1)  # [B, K]
    q_x = q.gather(-1, x[..., None]).squeeze(-1)
    accept = (u[:, :K] * q_x <= p_x) & is_draft
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B], length of the accepted prefix

    # 2. The next token comes from position `accepted`: the residual after a rejection there,
    #    or, when all K_b drafts were accepted, p_{K_b} itself (q counts as 0 at the bonus position).
    bonus = accepted == K_b
    p_next = p[rows, accepted]  # [B, V]
    q_next = torch.where(bonus[:, None], 0.0, q[rows, accepted.clamp(max=K - 1)])
    residual = (p_next - q_next).clamp(min=0)
    dist = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    next_token = inverse_cdf(dist, u[:, K])

    # 3. Emitted tokens: the accepted drafts, then the correction / bonus token.
    tokens = torch.full((B, K + 1), PAD, dtype=torch.long, device=p.device)
    tokens[:, :K] = torch.where(k < accepted[:, None], x, PAD)
    tokens[rows, accepted] = next_token
    num_emitted = accepted + 1
    if eos_token_id is not None:
        is_eos = (tokens == eos_token_id).long()
        first_eos = torch.where(is_eos.any(dim=-1), is_eos.argmax(dim=-1), K + 1)  # K+1: none
        num_emitted = torch.minimum(num_emitted, first_eos + 1)
    return VerifyResult(accepted, tokens, num_emitted, bonus)
