"""Checker of exercise 02x: the DFlash training mask of one sequence.

    dflash_mask(anchors: LongTensor[N], seq_len: int, block_size: int) -> BoolTensor[N*T, S + N*T]

Block j holds the anchor token x[a_j] and T - 1 mask tokens at positions a_j .. a_j + T - 1. Its T queries
may see context row c iff c < a_j (strictly: the anchor's own features come from the verify forward that
has not happened yet), and every row of their own block, in both directions, and nothing of another block.
The answer is compared with `minispec.dflash.mask.training_mask` on a few anchor layouts; the first wrong
entry is explained by the region it falls in.
"""
from __future__ import annotations

import torch

from minispec.dflash.mask import training_mask
from minispec.exercises.result import Wrong, as_tensor, call

CASES = (([3, 9], 16, 4), ([1], 6, 3), ([2, 5, 11], 14, 3), ([4], 12, 8))  # (anchors, seq_len, block_size)


def _explain(got: torch.Tensor, want: torch.Tensor, anchors: list[int], S: int, T: int) -> str:
    i, j = (got != want).nonzero()[0].tolist()
    block, k = divmod(i, T)
    a = anchors[block]
    where = f"query {i} (block {block}, anchor a = {a}, position a + {k})"
    if j < S:
        if (got[i, a:S] & ~want[i, a:S]).any() and got[i, a + 1:S].any():
            return (f"{where} sees context rows at or after its anchor {a}: that is the future; only rows c < a "
                    "are visible")
        if got[i, j] and j == a:
            return (f"{where} sees context row {j}, the anchor itself: the context is c < a, strictly (the anchor's "
                    "target features do not exist yet when the block is drafted)")
        return f"{where} does not see context row {j} < a = {a}: every committed row before the anchor is visible"
    key_block, key_k = divmod(j - S, T)
    if got[i, j]:
        return (f"{where} sees a row of block {key_block}: blocks are drafted independently and never see each "
                "other")
    if key_k > k:
        return (f"{where} does not see row {key_k} of its own block, after it: inside a block attention is "
                "bidirectional, not causal")
    return f"{where} does not see row {key_k} of its own block: a block sees all of its own T rows"


def check_dflash_mask(fn) -> str:
    for anchors, S, T in CASES:
        a = torch.tensor(anchors)
        want = training_mask(a[None], torch.ones(1, len(anchors), dtype=torch.bool), S, T)[0]
        got = as_tensor(call(fn, a.clone(), S, T), f"dflash_mask({anchors}, {S}, {T})", tuple(want.shape), "bool")
        if not torch.equal(got, want):
            raise Wrong(f"dflash_mask(anchors={anchors}, seq_len={S}, block_size={T}): "
                        f"{_explain(got, want, anchors, S, T)}.")
    return f"The mask is exact on {len(CASES)} anchor layouts (one to three blocks, T = 3 to 8)."
