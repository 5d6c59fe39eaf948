"""The teachers' answers to the exercise notebooks (01x .. 05x), one plain function per exercise.

Each is written the way a learner would: straight from the formula, without calling minispec's own
references (which the checkers compare against). `minispec.exercises.check(name, fn)` passes all of them.
"""
from __future__ import annotations

import torch


def verify_step(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> list[int]:
    """01x. drafts [K], p [K+1, V], q [K, V] -> the accepted drafts, then one correction or bonus token."""
    out = []
    for k, x in enumerate(drafts.tolist()):
        u = torch.rand((), generator=generator)
        if u < p[k, x] / q[k, x]:  # accept with probability min(1, p/q)
            out.append(x)
            continue
        residual = (p[k] - q[k]).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[-1], 1, generator=generator)))  # every draft accepted: the bonus
    return out


def dflash_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """02x. anchors [N] -> bool [N*T, S + N*T]: may block query i attend to key j (context rows, then block rows)."""
    block = torch.arange(len(anchors) * block_size) // block_size  # the block of each query
    sees_context = torch.arange(seq_len)[None, :] < anchors[block][:, None]  # strictly before its anchor
    sees_block = block[:, None] == block[None, :]  # its own block, in both directions
    return torch.cat([sees_context, sees_block], dim=1)


def mtp_draft(head, embed, lm_head, hidden: torch.Tensor, token: int, K: int) -> list[int]:
    """03x. K greedy drafts from an MTP head called recursively on its own output."""
    drafts = []
    for _ in range(K):
        out = head(hidden, embed(token))
        token = int(lm_head(out).argmax())
        drafts.append(token)
        hidden = out  # depth k + 1 reads the head's own output, standing in for the backbone's next state
    return drafts


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """04x. Round to the nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even, saturating at ±6."""
    a = x.abs().clamp(max=6.0)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))  # the grid spacing in each binade
    return torch.copysign(torch.round(a / step) * step, x)  # torch.round: half to even


def nvfp4_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """04x. x [R, K] -> (g, a 0-d float32 tensor; block scales [R, K // 16], E4M3 values as float32)."""
    g = (x.abs().max() / (6 * 448)).clamp(min=2.0**-126)
    block_amax = x.reshape(x.shape[0], -1, 16).abs().amax(dim=-1)
    scales = (block_amax / (6 * g)).clamp(min=2.0**-9, max=448.0)
    return g.float(), scales.to(torch.float8_e4m3fn).float()


def replay_verify(checkpoint, x, dt, B, C, A, D, start: int) -> torch.Tensor:
    """05x. checkpoint [H, P, N]; records x [L, H, P], dt [L, H], B [L, N]; window C [T, N]; A, D [H]
    -> y [T, H, P] of the window's T = L - start positions, from the checkpoint and the records."""
    S = checkpoint.clone()
    ys = []
    for i in range(x.shape[0]):
        S = torch.exp(dt[i] * A)[:, None, None] * S + (dt[i][:, None] * x[i])[:, :, None] * B[i]
        if i >= start:
            ys.append(S @ C[i - start] + D[:, None] * x[i])
    return torch.stack(ys)
