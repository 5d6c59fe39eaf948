"""Checker of exercise 03x: the recursive drafting loop of an MTP head.

    mtp_draft(head, embed, lm_head, hidden: FloatTensor[H], token: int, K: int) -> list[int]

`hidden` is the backbone's last hidden state, `token` the token sampled after it. Depth 1 calls
head(hidden, embed(token)) -> out [H]; its draft is argmax(lm_head(out)). Depth k reads the head's own
output of depth k - 1 and the embedding of draft k - 1. K calls of the same head give K greedy drafts.

The checker hands in a small random head and records every call, so a wrong answer is explained by the
first call whose inputs are not the ones the recursion prescribes.
"""
from __future__ import annotations

import operator

import torch

from minispec.exercises.result import Wrong, call

H, V = 16, 12


class ToyHead:
    """head(hidden [H], e [H]) -> out [H]: tanh(W_h hidden + W_e e), with every call recorded."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.W_h, self.W_e = torch.randn(H, H, generator=g) / H**0.5, torch.randn(H, H, generator=g) / H**0.5
        self.table = torch.randn(V, H, generator=g)
        self.W_out = torch.randn(V, H, generator=g)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def head(self, hidden: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.W_h @ hidden.reshape(H) + self.W_e @ e.reshape(H))
        self.calls.append((hidden.reshape(H).clone(), e.reshape(H).clone(), out.clone()))
        return out

    def embed(self, token) -> torch.Tensor:
        return self.table[int(token)]

    def lm_head(self, out: torch.Tensor) -> torch.Tensor:
        return self.W_out @ out.reshape(H)

    def expected(self, hidden: torch.Tensor, token: int, K: int) -> list[int]:
        drafts = []
        for _ in range(K):
            hidden = torch.tanh(self.W_h @ hidden + self.W_e @ self.table[token])
            token = int((self.W_out @ hidden).argmax())
            drafts.append(token)
        return drafts

    def which_token(self, e: torch.Tensor) -> int | None:
        match = (self.table - e).abs().amax(dim=1) < 1e-6
        return int(match.nonzero()[0]) if match.any() else None


def _explain(toy: ToyHead, hidden: torch.Tensor, token: int, K: int, drafts: list[int]) -> str:
    calls = toy.calls
    if len(calls) != K:
        return (f"the head was called {len(calls)} times for K = {K} drafts: call it once per draft (depth), "
                "K times in all")
    prev_out, prev_token = hidden, token
    for depth, (h_in, e_in, out) in enumerate(calls, start=1):
        if not torch.allclose(h_in, prev_out, atol=1e-6):
            if depth > 1 and torch.allclose(h_in, hidden, atol=1e-6):
                return (f"depth {depth} read the backbone's hidden state again: depth k must read the head's own "
                        "output of depth k - 1 (that is the recursion; it stands in for the backbone's next state)")
            return (f"depth {depth} read a hidden state that is neither the backbone's (depth 1) nor the head's "
                    "output of the previous depth")
        t = toy.which_token(e_in)
        if t != prev_token:
            if depth > 1 and t == token:
                return (f"depth {depth} read the embedding of the original `token` again: depth k reads the "
                        "embedding of draft k - 1, the token it is predicting after")
            return (f"depth {depth} read the embedding of token {t}, expected {prev_token} "
                    f"({'the given token' if depth == 1 else f'draft {depth - 1}'})")
        want = int(toy.lm_head(out).argmax())
        if drafts[depth - 1] != want:
            from_input = int(toy.lm_head(h_in).argmax())
            if drafts[depth - 1] == from_input:
                return (f"draft {depth} is the argmax of lm_head(hidden input of depth {depth}); it must be the argmax "
                        "of lm_head(out), the head's output")
            return f"draft {depth} is {drafts[depth - 1]}, but argmax(lm_head(out of depth {depth})) is {want}"
        prev_out, prev_token = out, want
    return "the drafts differ from the recursion's"


def check_mtp_draft(fn) -> str:
    for seed, K in ((0, 1), (1, 4), (2, 6), (3, 3)):
        toy = ToyHead(seed)
        g = torch.Generator().manual_seed(100 + seed)
        hidden, token = torch.randn(H, generator=g), int(torch.randint(V, (), generator=g))
        got = call(fn, toy.head, toy.embed, toy.lm_head, hidden.clone(), token, K)
        if isinstance(got, torch.Tensor):
            got = got.flatten().tolist()
        try:
            got = [operator.index(t) for t in got]
        except TypeError:
            raise Wrong(f"mtp_draft must return a list of K int token ids, got {got!r}") from None
        if len(got) != K:
            raise Wrong(f"mtp_draft returned {len(got)} drafts for K = {K}: one draft per depth, K in all")
        if list(got) != toy.expected(hidden, token, K):
            raise Wrong(f"K = {K}: {_explain(toy, hidden, token, K, list(got))}.")
    return "The drafts match the recursion on 4 random heads (K = 1, 3, 4, 6), every call reading the right inputs."
