"""The teachers' answers to the exercise notebooks (01x .. 06x), one plain function per exercise.

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


def dflash_mask(anchors: torch.Tensor, seq_len: int, block_size: int, window: int | None = None,
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """02x. anchors [N] -> bool [N*T, S + N*T]: may block query i attend to key j (context rows, then block rows)."""
    query = torch.arange(len(anchors) * block_size)
    block = query // block_size  # the block of each query
    c, anchor = torch.arange(seq_len)[None, :], anchors[block][:, None]
    sees_context = c < anchor  # strictly before its anchor
    if window is not None:
        sees_context &= (anchor + query[:, None] % block_size) - c < window  # counted from the query's position
    sees_block = block[:, None] == block[None, :]  # its own block, in both directions
    allow = torch.cat([sees_context, sees_block], dim=1)
    return allow if valid is None else allow & valid[block][:, None]  # a padding block sees nothing


def mtp_draft(head, embed, lm_head, hidden: torch.Tensor, token: int, K: int) -> list[int]:
    """03x. K greedy drafts from an MTP head called recursively on its own output."""
    drafts = []
    for _ in range(K):
        out = head(hidden, embed(token))
        token = int(lm_head(out).argmax())
        drafts.append(token)
        hidden = out  # depth k + 1 reads the head's own output, standing in for the backbone's next state
    return drafts


def boost_loss(teacher: torch.Tensor, student: torch.Tensor, loss_mask: torch.Tensor):
    """03x. teacher [S, V] backbone logits, student [K, S, V] the head's logits per depth at slots, loss_mask [S]
    -> (kl [K], one_minus_tv [K]): slot j of depth k is taught by the backbone at position j+1."""
    K, S, _ = student.shape
    logp = torch.log_softmax(teacher[1:].detach(), -1)  # the frozen backbone: a constant target
    kl, accept = [], []
    for k in range(1, K + 1):
        counted = loss_mask[1:].bool() & (torch.arange(S - 1) >= k - 1)  # reply tokens; a chain back to slot 0
        logq = torch.log_softmax(student[k - 1, :-1], -1)
        kl.append((logp.exp() * (logp - logq)).sum(-1)[counted].mean())
        accept.append(torch.minimum(logp.exp(), logq.exp()).sum(-1)[counted].mean())
    return torch.stack(kl), torch.stack(accept).detach()


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


def qad_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, mask: torch.Tensor,
           temperature: float) -> torch.Tensor:
    """04x. Mean over the positions where mask is 1 of KL(softmax(t / T) ‖ softmax(s / T)), no T² factor."""
    log_p_t = torch.log_softmax(teacher_logits / temperature, dim=-1)
    log_p_s = torch.log_softmax(student_logits / temperature, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)  # summed over the vocabulary, one per position
    return (kl * mask).sum() / mask.sum()


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


def replay_cycles(checkpoint, cycles, A, D, capacity: int) -> list:
    """05x. Speculative cycles over one checkpoint and a ring of `capacity` records -> per cycle (y, checkpoint)."""
    records = ([], [], [])  # x, dt, B of the records since the checkpoint: the committed ones first
    count, out = 0, []
    for x, dt, B, C, n in cycles:
        if count + len(x) > capacity:  # the window does not fit: flush, the only time the state is written
            for i in range(count):
                rx, rdt, rB = records[0][i], records[1][i], records[2][i]
                checkpoint = torch.exp(rdt * A)[:, None, None] * checkpoint + (rdt[:, None] * rx)[:, :, None] * rB
            records, count = ([], [], []), 0
        records = tuple(r[:count] + list(w) for r, w in zip(records, (x, dt, B)))  # over the rejected ones
        y = replay_verify(checkpoint, *(torch.stack(r) for r in records), C, A, D, count)
        count += n  # commit: the rejected records are simply not counted
        out.append((y, checkpoint))
    return out


def forward_seconds(batch: int, tokens_per_seq: int, weight_bytes: float, seq_bytes: float, flops_per_token: float,
                    bandwidth: float, peak_flops: float) -> float:
    """06x. The roofline time of one forward of a dense model: the slower of moving its bytes and doing its FLOPs."""
    moved = weight_bytes + batch * seq_bytes  # the weights once per forward; each sequence's KV cache once
    work = batch * tokens_per_seq * flops_per_token  # every new token of every sequence
    return max(moved / bandwidth, work / peak_flops)


def break_even_batch(cost, tau: float, num_drafts: int, draft_ratio: float, max_batch: int) -> int | None:
    """06x. The first batch at which tau · C_t / (C_d + C_v) <= 1, or None if speculation pays up to max_batch."""
    for batch in range(1, max_batch + 1):
        c_t = cost(batch, 1)
        if tau * c_t / (draft_ratio * c_t + cost(batch, num_drafts + 1)) <= 1:
            return batch
    return None
