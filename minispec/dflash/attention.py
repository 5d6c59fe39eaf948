"""DFlash's attention: a block of queries over cached context plus the block's own keys.

The drafter's layers call `dflash_attention` at inference (`minispec.dflash.model`); training builds
the equivalent boolean mask for all blocks at once (`minispec.dflash.mask`) and calls
`masked_attention`. `dflash_attention` is the reference of the Triton kernel
`minispec.kernels.attention.dflash_attention` (kernels/attention.py): same signature, arguments checked
by the same `check_attention_args`, and CUDA tensors dispatched to it. tests/test_dflash_attention.py
checks the kernel against this reference.
"""
from __future__ import annotations

import torch

from minispec.backend import dispatch


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allow: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Softmax attention with an explicit boolean mask and grouped-query heads.

    q: [B, Q, Hq, D]; k, v: [B, K, Hkv, D]; allow: [B, Q, K] (True = may attend) -> [B, Q, Hq, D].
    A query that may attend to nothing (a padding block) gets zeros, not NaN.
    """
    B, Q, Hq, D = q.shape
    group = Hq // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = k.repeat_interleave(group, dim=2)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    allow = allow[:, None]  # [B, 1, Q, K], the same for every head
    scores = scores.masked_fill(~allow, torch.finfo(scores.dtype).min)
    probs = scores.softmax(dim=-1) * allow.any(dim=-1, keepdim=True)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)


def check_attention_args(q, k_ctx, v_ctx, k_blk, v_blk, ctx_lens, window) -> None:
    """Shapes and values `dflash_attention` (reference and kernel) accepts."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {tuple(q.shape)}")
    B, T, Hq, D = q.shape
    if k_ctx.dim() != 4 or k_ctx.shape[0] != B or k_ctx.shape[3] != D or v_ctx.shape != k_ctx.shape:
        raise ValueError(f"k_ctx and v_ctx must both be [B={B}, C, Hkv, D={D}], got {tuple(k_ctx.shape)} and "
                         f"{tuple(v_ctx.shape)}")
    Hkv = k_ctx.shape[2]
    if k_blk.shape != (B, T, Hkv, D) or v_blk.shape != k_blk.shape:
        raise ValueError(f"k_blk and v_blk must both be [B={B}, T={T}, Hkv={Hkv}, D={D}], got {tuple(k_blk.shape)} "
                         f"and {tuple(v_blk.shape)}")
    if Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the kv heads ({Hkv})")
    if ctx_lens.shape != (B,) or ctx_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ctx_lens must be an integer tensor of shape [B={B}], got {ctx_lens.dtype} "
                         f"{tuple(ctx_lens.shape)}")
    if B and (int(ctx_lens.min()) < 0 or int(ctx_lens.max()) > k_ctx.shape[1]):
        raise ValueError(f"ctx_lens must lie in [0, {k_ctx.shape[1]}] (the cached context width), got "
                         f"{ctx_lens.tolist()}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < T):
        raise ValueError(f"window must be None or an int >= the block length T={T}, got {window!r}")


@dispatch("attention:dflash_attention")
def dflash_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                     v_blk: torch.Tensor, ctx_lens: torch.Tensor, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """DFlash's inference attention: a block of T queries over cached context plus the block's own keys.

    q:            [B, T, Hq, D]   the block's queries (q_norm and RoPE applied)
    k_ctx, v_ctx: [B, C, Hkv, D]  row b's context in its first ctx_lens[b] slots, the newest last; the
                                  context ends right before the block (at the anchor's position - 1)
    k_blk, v_blk: [B, T, Hkv, D]  the block's own keys and values
    ctx_lens:     [B]             how many context slots of each row are real
    window:       None, or a sliding window W: block query t of row b sees context slot i only if
                  the distance (ctx_lens[b] - i) + t is below W. Block keys are always seen (W >= T).
    -> [B, T, Hq, D]

    Non-causal: every query sees every key of its own block, in both directions. Query head h reads
    kv head h // (Hq / Hkv). Scale 1/sqrt(D) unless given.
    """
    check_attention_args(q, k_ctx, v_ctx, k_blk, v_blk, ctx_lens, window)
    B, T = q.shape[:2]
    C = k_ctx.shape[1]
    slot = torch.arange(C, device=q.device)
    lens = ctx_lens.to(q.device)[:, None, None]  # [B, 1, 1]
    sees_ctx = (slot < lens).expand(B, T, C)  # [B, T, C]
    if window is not None:
        distance = (lens - slot) + torch.arange(T, device=q.device)[None, :, None]
        sees_ctx = sees_ctx & (distance < window)
    sees_block = torch.ones(B, T, T, dtype=torch.bool, device=q.device)  # bidirectional inside the block
    allow = torch.cat([sees_ctx, sees_block], dim=-1)
    return masked_attention(q, torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), allow, scale)
