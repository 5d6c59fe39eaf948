"""`DFlashDrafter`: the DFlash drafter behind the speculative loop's drafter protocol.

    begin(prompt, prefill)       the taps of every real prompt token become the draft cache's context
    propose(last, K)             block [last, <mask> x (B-1)] at positions p .. p+B-1, ONE forward,
                                 d_k = argmax of block position k (k = 1..K), q = None (one-hot)
    commit(accepted a, verify)   the taps of [last, d_1 .. d_a] (from the verify forward) join the
                                 context; the rejected drafts' features never enter the cache

Drafts are always argmax, at every temperature: the block's outputs are per-position marginals, not
a joint distribution, so sampling each position independently is both wrong as a proposal and
measured to collapse acceptance (z-lab/dflash PR #169: 1.16 accepted tokens per step at T = 1 against
2.96 with argmax drafts). With argmax drafts and one-hot q the loop's rejection sampling ("accept d_k
with probability p_k(d_k)") keeps the output exactly the target's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from minispec.dflash.model import DFlashCache, DFlashDraftModel
from minispec.drafters.base import Proposal, Sampling
from minispec.speculative.batch import PromptBatch
from minispec.speculative.target import TargetOutput


class DFlashDrafter:
    needs_hidden_states = True

    def __init__(self, model: DFlashDraftModel, target, num_draft_tokens: int | None = None,
                 block_size: int | None = None):
        cfg = model.config
        if block_size is not None and block_size != cfg.block_size:
            raise ValueError(f"block_size {block_size} differs from the drafter's config ({cfg.block_size}): a DFlash "
                             "drafter runs the block size it was trained with")
        model.attach_target(target)
        self.model = model.eval()
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.vocab_size = cfg.vocab_size
        self.num_draft_tokens = self.block_size - 1 if num_draft_tokens is None else num_draft_tokens
        self._check_k(self.num_draft_tokens)
        self.cache: DFlashCache | None = None
        self.last_logits: torch.Tensor | None = None  # [B, T, V] of the latest block, for visualizations

    @classmethod
    def from_pretrained(cls, folder, target, **kwargs) -> DFlashDrafter:
        """Load a drafter saved with `save_pretrained` or exported in the HF-native DFlash format; it computes
        in the target's dtype (weights are stored in bf16, and bf16 matmuls are slow on most CPUs)."""
        from minispec.dflash.export import load_drafter_model

        return cls(load_drafter_model(Path(folder), target).to(target.dtype), target, **kwargs)

    def _check_k(self, k: int) -> None:
        if not isinstance(k, int) or not 1 <= k <= self.block_size - 1:
            raise ValueError(f"a DFlash block of {self.block_size} positions drafts 1 to {self.block_size - 1} "
                             f"tokens (the anchor takes one position); got K={k!r}")

    @torch.no_grad()
    def begin(self, batch: PromptBatch, target_out: TargetOutput) -> None:
        if target_out.hidden_states is None:
            raise ValueError("DFlash needs the target's hidden states: run the target with output_hidden_states")
        self.cache = self.model.new_cache(batch.size)
        self.model.extend_cache(self.cache, self.model.tap(target_out.hidden_states), batch.attention_mask.bool())

    @torch.no_grad()
    def propose(self, last: torch.Tensor, k: int, sampling: Sampling, generator=None) -> Proposal:
        self._check_k(k)
        masks = torch.full((len(last), self.block_size - 1), self.mask_token_id, dtype=torch.long, device=last.device)
        block = torch.cat([last[:, None], masks], dim=1).to(self.model.device)
        self.last_logits = self.model.draft(block, self.cache)
        drafts = self.last_logits[:, 1: 1 + k].argmax(dim=-1)  # block position k proposes token k
        return Proposal(drafts.to(last.device), q=None)

    @torch.no_grad()
    def commit(self, accepted: torch.Tensor, tokens: torch.Tensor, target_out: TargetOutput) -> None:
        features = self.model.tap(target_out.hidden_states)  # over [last, d_1 .. d_K]
        n = features.shape[1]
        keep = torch.arange(n, device=features.device)[None, :] < (accepted.to(features.device) + 1)[:, None]
        self.model.extend_cache(self.cache, features, keep)
