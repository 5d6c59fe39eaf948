"""Checker of exercise 02x: the DFlash training mask of one sequence.

    dflash_mask(anchors: LongTensor[N], seq_len: int, block_size: int, window: int | None = None,
                valid: BoolTensor[N] | None = None) -> BoolTensor[N*T, S + N*T]

Block j holds the anchor token x[a_j] and T - 1 mask tokens at positions a_j .. a_j + T - 1. Its T queries
may see context row c iff c < a_j (strictly: the anchor's own features come from the verify forward that
has not happened yet) and, on a sliding-window layer (`window` = W), p - c < W, where p = a_j + k is the
query's own position; and every row of their own block, in both directions, and nothing of another block.
A padding block (`valid[j]` False: a sequence with fewer anchors than the batch's longest) sees nothing.
The answer is compared with `minispec.dflash.mask.training_mask` on plain layouts first, then with a window,
then with padding; the first wrong entry is explained by the region it falls in.
"""
from __future__ import annotations

import torch

from minispec.dflash.mask import training_mask
from minispec.exercises.result import Wrong, as_tensor, call

# (anchors, seq_len, block_size, window, valid): plain layouts, then sliding windows (W >= T, as the drafter's
# attention requires), then padding blocks, one of them at anchor 0 as `sample_anchors` pads and one elsewhere.
CASES = (
    ([3, 9], 16, 4, None, None), ([1], 6, 3, None, None), ([2, 5, 11], 14, 3, None, None), ([4], 12, 8, None, None),
    ([9], 16, 4, 5, None), ([3, 10], 16, 4, 6, None), ([6], 10, 3, 3, None),
    ([2, 7, 0], 12, 3, None, [True, True, False]), ([4, 6], 10, 2, None, [True, False]),
    ([3, 8, 0], 14, 4, 5, [True, True, False]),
)


def _call_text(anchors, S, T, window, valid) -> str:
    extra = "" if window is None else f", window={window}"
    extra += "" if valid is None else f", valid={valid}"
    return f"dflash_mask(anchors={anchors}, seq_len={S}, block_size={T}{extra})"


def _explain(got: torch.Tensor, want: torch.Tensor, anchors: list[int], S: int, T: int, window: int | None,
             valid: list[bool]) -> str:
    i, j = (got != want).nonzero()[0].tolist()
    block, k = divmod(i, T)
    a, p = anchors[block], anchors[block] + k
    where = f"query {i} (block {block}, anchor a = {a}, position p = a + {k} = {p})"
    if not valid[block]:
        return (f"{where} belongs to a padding block (valid[{block}] is False) and sees "
                f"{'context row' if j < S else 'block row'} {j if j < S else j - S}: a padding block sees nothing, "
                "not even its own rows")
    if j < S:
        if (got[i, a:S] & ~want[i, a:S]).any() and got[i, a + 1:S].any():
            return (f"{where} sees context rows at or after its anchor {a}: that is the future; only rows c < a "
                    "are visible")
        if got[i, j] and j == a:
            return (f"{where} sees context row {j}, the anchor itself: the context is c < a, strictly (the anchor's "
                    "target features do not exist yet when the block is drafted)")
        if got[i, j]:  # j < a, so only the window can hide it
            if a - j < window:
                return (f"{where} sees context row {j}, p - {j} = {p - j} positions back with W = {window}: the "
                        "window counts from the query's own position p = a + k, not from the anchor")
            if p - j == window:
                return (f"{where} sees context row {j}, exactly W = {window} positions back: a sliding layer keeps "
                        "p - c < W, strictly")
            return (f"{where} sees context row {j}, {p - j} positions back: a sliding layer (W = {window}) keeps "
                    "only rows with p - c < W")
        if window is not None:
            return (f"{where} does not see context row {j}, which is before the anchor and p - {j} = {p - j} < "
                    f"W = {window}: inside the window, every row before the anchor is visible")
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
    for anchors, S, T, window, valid in CASES:
        a = torch.tensor(anchors)
        v = torch.tensor(valid if valid is not None else [True] * len(anchors))
        want = training_mask(a[None], v[None], S, T, window)[0]
        text = _call_text(anchors, S, T, window, valid)
        try:
            args = (a.clone(), S, T) if window is None and valid is None else (a.clone(), S, T, window, v.clone())
            got = as_tensor(call(fn, *args), "the result", tuple(want.shape), "bool")
        except Wrong as wrong:
            raise Wrong(f"{text}: {wrong}") from None
        if not torch.equal(got, want):
            raise Wrong(f"{text}: {_explain(got, want, anchors, S, T, window, v.tolist())}.")
    return (f"The mask is exact on {len(CASES)} layouts: one to three blocks, T = 2 to 8, sliding windows of 3 to "
            "6, padding blocks.")
