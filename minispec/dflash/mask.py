"""DFlash training: anchors, blocks, the block attention mask, labels and loss weights.

The recipe of the public trainers (SpecForge `specforge/core/dflash.py`, NVIDIA Model Optimizer
`hf_dflash.py`); z-lab has not published its own.

At inference the drafter sees the committed context, then one block [x_a, <mask> x (B-1)] at
positions a .. a+B-1, and block position k proposes the token at position a+k. Training puts many
such blocks of one sequence into ONE forward, and everything here exists so that each block sees
exactly what it would see at inference:

    anchors   a_1 < ... < a_N   sampled per sequence among positions that carry loss
    block j   tokens [x[a_j], <mask> x (B-1)] at positions a_j .. a_j + B - 1
    keys      [context rows 0 .. S-1 ; the N*B block rows]          queries: block rows only
    query in block j may see
        context row c   iff  c < a_j  (STRICTLY: the anchor's own features come from the verify
                                       forward that has not happened yet)
                        and  pos(query) - c < W  on a sliding-window layer
        block row       iff  it is in block j (bidirectional inside the block, never another block)
    padding blocks (valid = False) see nothing
    label(j, k)  = x[a_j + k]                 same position, no shift; k = 0 (the anchor) has no loss
    weight(j, k) = valid_j * [a_j + k < S] * loss_mask[a_j + k] * exp(-(k-1) / gamma)
    loss         = sum(weight * CE) / sum(weight)

Public re-implementations that got one of these wrong trained to high accuracy and then accepted
almost nothing at inference (SpecForge #427, #455 -> #473; z-lab/dflash #41: "training acc 0.99 but
accept ratio 0.12"): a causal block, labels shifted by one, `<=` instead of `<` at the anchor, blocks
leaking into each other, padding blocks that were not isolated.

Shapes: Bs sequences of length S, N blocks of T = block_size positions, Q = N * T block queries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minispec.dflash.config import DEFAULT_GAMMA


def sample_anchors(loss_mask: torch.Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors, drawn per sequence without replacement, sorted.

    loss_mask: [Bs, S] (1 where a token is trained on; 0 on padding). Candidates of row b are the
    positions t with 1 <= t <= S - block_size and loss_mask[b, t] = 1: a whole block fits, and the
    anchor has context before it (at inference the anchor always follows at least one prompt token).
    -> anchors [Bs, N] (long), valid [Bs, N] (bool), N = min(num_anchors, most candidates of any row).
    Rows with fewer candidates are padded with invalid blocks (anchor 0), which the mask isolates and
    the loss ignores.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    Bs, S = loss_mask.shape
    t = torch.arange(S, device=loss_mask.device)
    candidate = (loss_mask != 0) & (t >= 1) & (t <= S - block_size)  # [Bs, S]
    N = min(num_anchors, int(candidate.sum(dim=1).max()) if Bs else 0)
    keys = torch.rand(Bs, S, generator=generator, device="cpu" if generator is None else generator.device)
    keys = keys.to(loss_mask.device).masked_fill(~candidate, 2.0)  # non-candidates sort last
    picked = keys.topk(N, dim=1, largest=False).indices  # a uniform random subset of the candidates
    chosen = candidate.gather(1, picked)
    anchors = torch.where(chosen, picked, S).sort(dim=1).values  # ascending; padding (S) at the end
    valid = anchors < S
    return anchors.masked_fill(~valid, 0), valid


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[Bs, N] anchors -> [Bs, N, T] positions a_j .. a_j + T - 1."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    mask_token_id: int) -> torch.Tensor:
    """[Bs, S] tokens, [Bs, N] anchors -> [Bs, N, T]: the anchor token, then T-1 mask tokens."""
    blocks = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype,
                        device=input_ids.device)
    blocks[..., 0] = input_ids.gather(1, anchors)
    return blocks


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[Bs, N, T]: label(j, k) = x[a_j + k], the token AT block position k's own position (no shift).
    Positions past the end get the last token; their weight is 0."""
    index = block_positions(anchors, block_size).clamp(max=input_ids.shape[1] - 1)
    return input_ids.gather(1, index.flatten(1)).view(index.shape)


def decay_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[T]: 0 for the anchor (k = 0), exp(-(k-1)/gamma) for k >= 1 (the first draft position gets 1).

    gamma defaults to the published suggestion for the block size (4 for B = 8, 5 for 10, 7 for 16).
    """
    if gamma is None:
        if block_size not in DEFAULT_GAMMA:
            raise ValueError(f"no default gamma for block size {block_size} (known: {sorted(DEFAULT_GAMMA)}); "
                             "pass gamma")
        gamma = DEFAULT_GAMMA[block_size]
    if not gamma > 0 or not math.isfinite(gamma):
        raise ValueError(f"gamma must be a positive finite number, got {gamma!r}")
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k == 0, 0.0, torch.exp(-(k - 1) / gamma))


def loss_weights(anchors: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                 gamma: float | None = None) -> torch.Tensor:
    """[Bs, N, T]: valid_j * [a_j + k < S] * loss_mask[a_j + k] * decay_k (decay_0 = 0)."""
    S = loss_mask.shape[1]
    pos = block_positions(anchors, block_size)
    inside = pos < S
    trained = loss_mask.gather(1, pos.clamp(max=S - 1).flatten(1)).view(pos.shape) != 0
    decay = decay_weights(block_size, gamma).to(loss_mask.device)
    return valid[..., None] * inside * trained * decay


def training_mask(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int,
                  window: int | None = None) -> torch.Tensor:
    """The block attention mask: [Bs, Q, S + Q] over keys [context rows ; block rows], Q = N * T.

    Query q belongs to block j = q // T, at position a_j + q % T. It may see context row c iff
    c < a_j (and a_j + q % T - c < window on a sliding layer), and block row r iff r // T == j.
    Padding blocks see nothing.
    """
    Bs, N = anchors.shape
    T, S, Q = block_size, seq_len, N * block_size
    device = anchors.device
    q = torch.arange(Q, device=device)
    block_of_q = q // T  # [Q]
    anchor = anchors[:, block_of_q]  # [Bs, Q]
    position = anchor + q % T  # [Bs, Q]
    c = torch.arange(S, device=device)
    sees_context = c[None, None, :] < anchor[:, :, None]  # strictly before the anchor
    if window is not None:
        sees_context = sees_context & (position[:, :, None] - c[None, None, :] < window)
    sees_block = (block_of_q[:, None] == block_of_q[None, :]).expand(Bs, Q, Q)  # own block, both ways
    allow = torch.cat([sees_context, sees_block], dim=-1)
    return allow & valid[:, block_of_q, None]  # padding blocks see nothing


@dataclass
class Blocks:
    """The training blocks of a batch of sequences (all [Bs, N] or [Bs, N, T])."""
    anchors: torch.Tensor  # [Bs, N]
    valid: torch.Tensor  # [Bs, N]
    input_ids: torch.Tensor  # [Bs, N, T] anchor token, then masks
    positions: torch.Tensor  # [Bs, N, T]
    labels: torch.Tensor  # [Bs, N, T] x[a + k]
    weights: torch.Tensor  # [Bs, N, T] loss weights (0 at the anchor, on padding, past the end)


def make_blocks(input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                mask_token_id: int, loss_mask: torch.Tensor | None = None, gamma: float | None = None) -> Blocks:
    """Blocks, labels and weights for `anchors` of right-padded sequences `input_ids` [Bs, S]."""
    if loss_mask is None:
        loss_mask = torch.ones_like(input_ids)
    return Blocks(anchors, valid, block_input_ids(input_ids, anchors, block_size, mask_token_id),
                  block_positions(anchors, block_size), block_labels(input_ids, anchors, block_size),
                  loss_weights(anchors, valid, loss_mask, block_size, gamma))


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * CE(logits, labels)) / sum(w): logits [..., V], labels and weights [...]. 0 if no weight."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    w = weights.flatten().to(ce.dtype)
    return (w * ce).sum() / w.sum().clamp(min=torch.finfo(ce.dtype).tiny)


def weighted_accuracy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> float:
    """Share of the weighted positions whose argmax is the label (the decay weights the positions)."""
    hit = (logits.argmax(dim=-1) == labels).to(weights.dtype)
    return float((hit * weights).sum() / weights.sum().clamp(min=1e-12))


def acceptance_length(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                      valid: torch.Tensor) -> tuple[float, int]:
    """(mean tau, number of blocks) of greedy verification, read off training blocks.

    A block anchored in a greedy reply of the target is what a cycle of the loop sees at T = 0: the
    target's next tokens are the labels, and it accepts drafts up to the first miss, then adds one token
    of its own. So tau of a block = 1 + the run of leading hits at k = 1, 2, ..., where a position past
    the reply's end (weight 0) ends the run. logits [Bs, N, T, V]; labels, weights [Bs, N, T]; valid [Bs, N].
    """
    run = leading_hits(logits, labels, weights)  # [Bs, N]
    n = int(valid.sum())
    return float((1 + run)[valid].float().sum()) / max(n, 1), n


def leading_hits(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[..., T, V], [..., T], [..., T] -> [...]: each block's run of leading hits at k = 1, 2, ... (the drafts
    greedy verification accepts); a position past the reply's end (weight 0) ends the run."""
    hit = (logits.argmax(dim=-1) == labels) & (weights > 0)
    return hit[..., 1:].long().cumprod(dim=-1).sum(dim=-1)


def walk(runs: list[int]) -> list[int]:
    """The positions greedy verification drafts at in one reply, given the leading hits `runs[i]` of a block
    anchored at EVERY reply position i = 0 .. N-1 (the reply's first token to the one before its last). The
    loop's tau over the reply is N / len(walk(runs)): tokens per cycle.

    The loop does not visit positions uniformly: it drafts at the first token, accepts runs[0] drafts, adds one
    token of its own and drafts next at runs[0] + 1, and so on. A stretch the drafter gets wrong costs a cycle per
    token and an easy one few cycles in all, so the loop's tau sits below the mean of `acceptance_length` over
    uniformly drawn anchors (a harmonic-type mean against an arithmetic one)."""
    visited, a = [], 0
    while a < len(runs):
        visited.append(a)
        a += runs[a] + 1
    return visited
