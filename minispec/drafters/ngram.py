"""Prompt-lookup (n-gram) drafting: no weights, just copying.

If the last n tokens appeared earlier in the text, guess that what followed them then follows them
now. Code repeats itself (names, signatures, boilerplate), so this drafter is free and often right.
Drafts are deterministic, so verification treats q as one-hot.
"""
from __future__ import annotations

import torch

from minispec.speculative.batch import PromptBatch
from minispec.speculative.drafter import Proposal, Sampling, check_num_draft_tokens
from minispec.speculative.output import TargetOutput


def lookup(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The (up to) k tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram of `history` (max_n >= n >= min_n); [] if none occurred."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


class NGramDrafter:
    needs_hidden_states = False

    def __init__(self, vocab_size: int, num_draft_tokens: int = 4, max_n: int = 4, min_n: int = 1):
        check_num_draft_tokens(num_draft_tokens)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.vocab_size, self.num_draft_tokens = vocab_size, num_draft_tokens
        self.max_n, self.min_n = max_n, min_n
        self.history: list[list[int]] = []
        self._last: list[int] = []

    def begin(self, batch: PromptBatch, target_out: TargetOutput) -> None:
        self.history = [row[row_mask.bool()].tolist() for row, row_mask in zip(batch.input_ids, batch.attention_mask)]

    def propose(self, last: torch.Tensor, k: int, sampling: Sampling, generator=None) -> Proposal:
        self._last = last.tolist()
        tokens = torch.zeros(len(last), k, dtype=torch.long)
        lengths = torch.ones(len(last), dtype=torch.long)
        for b, t in enumerate(last.tolist()):
            guess = lookup(self.history[b] + [t], k, self.max_n, self.min_n) or [t]
            tokens[b, : len(guess)] = torch.tensor(guess)
            lengths[b] = len(guess)
        return Proposal(tokens, None, lengths)

    def commit(self, accepted: torch.Tensor, tokens: torch.Tensor, target_out: TargetOutput) -> None:
        # History holds everything before `last`; the new `last` (tokens[b, a]) arrives with propose.
        for b, a in enumerate(accepted.tolist()):
            self.history[b] += [self._last[b]] + tokens[b, :a].tolist()
