"""Classic draft-model speculative decoding: a small LM samples K tokens one by one.

The drafts are *sampled* from the draft model's distribution q (through the same temperature /
top-k / top-p as the target), and verification uses the full q: accept with min(1, p/q), resample
from the residual on rejection. At temperature 0 the drafts are the draft model's argmax.

With `argmax_drafts=True` the drafter always proposes its argmax, at any temperature; verification
then treats q as one-hot (accept with probability p(x)). Both are exact; they accept differently.
"""
from __future__ import annotations

import torch

from minispec.speculative import sampling as smp
from minispec.speculative.batch import PromptBatch
from minispec.speculative.drafter import Proposal, Sampling, check_num_draft_tokens
from minispec.speculative.output import TargetOutput
from minispec.speculative.target import target_adapter


class DraftLMDrafter:
    needs_hidden_states = False

    def __init__(self, model, num_draft_tokens: int = 4, argmax_drafts: bool = False):
        check_num_draft_tokens(num_draft_tokens)
        self.model = model
        self.argmax_drafts = argmax_drafts
        self.lm = target_adapter(model)
        self.vocab_size = model.config.vocab_size
        self.num_draft_tokens = num_draft_tokens
        self._k = 0

    def begin(self, batch: PromptBatch, target_out: TargetOutput) -> None:
        self.lm.check_speculative(batch)  # its drafts are rolled back as the target's are
        self.lm.prefill(batch)

    @torch.no_grad()
    def propose(self, last: torch.Tensor, k: int, sampling: Sampling, generator=None) -> Proposal:
        tokens, qs = [], []
        greedy = self.argmax_drafts or sampling.greedy
        x = last[:, None]
        for _ in range(k):
            logits = self.lm.forward(x).logits[:, -1]
            q = sampling.probs(logits)
            d = smp.greedy(logits) if greedy else smp.sample(q, generator)
            tokens.append(d)
            qs.append(q)
            x = d[:, None]
        # Feed d_K as well, so the cache covers [last, d_1 .. d_K] and any outcome is a pure rollback.
        self.lm.forward(x)
        self._k = k
        q = None if greedy else torch.stack(qs, dim=1)
        return Proposal(torch.stack(tokens, dim=1), q)

    def commit(self, accepted: torch.Tensor, tokens: torch.Tensor, target_out: TargetOutput) -> None:
        self.lm.rollback(accepted + 1, self._k + 1)
