"""`DFlashDrafter`: the DFlash drafter behind the speculative loop's drafter protocol.

    begin(prompt, prefill)       the taps of every real prompt token become the draft cache's context
    propose(last, K)             block [last, <mask> x (B-1)] at positions p .. p+B-1, ONE forward: block
                                 position k (k = 1..K) gives q_k, a distribution over the draft vocabulary;
                                 the drafting policy turns q_1 .. q_K into drafts d_1 .. d_K
    commit(accepted a, verify)   the taps of [last, d_1 .. d_a] (from the verify forward) join the
                                 context; the rejected drafts' features never enter the cache

Two drafting policies, both exact (the output is distributed exactly as the target's):

    "argmax"  d_k = argmax q_k, sent as a deterministic draft (q = None): the verifier accepts d_k with
              probability p_k(d_k), the target's probability of it (rejection sampling with a one-hot q).
    "sample"  at T > 0, each d_k drawn independently from q_k at the request's temperature / top-k /
              top-p, and q_k sent to the verifier, which accepts with min(1, p_k(d_k) / q_k(d_k)).
              At T = 0 it is the argmax.

"sample" is exact although the block's outputs are per-position marginals, not a joint distribution.
Rejection sampling needs q_k to be the distribution d_k was really drawn from, given everything the
verifier conditions on; the block is computed before any draft is drawn, so given the block d_k ~ q_k
whatever d_1 .. d_{k-1} turned out to be. That q_k ignores the earlier drafts can cost acceptance, never
exactness. Per position, argmax drafts are accepted with p_k(argmax q_k) and sampled ones with
sum min(p_k, q_k) = 1 - TV(p_k, q_k): which is larger depends on the drafter, the target and the
temperature, so it is measured, per temperature and policy, by
`python -m minispec.bench dflash --policies argmax sample`. z-lab/dflash PR #169 measured their drafters
at T = 1 (MLX): 1.16 accepted tokens per step with independent per-position sampling against 2.96 with
argmax drafts; that is a measurement of those drafters on those targets, not a property of the policy.

A drafter with a reduced draft vocabulary (`config.draft_vocab_size`) drafts only tokens of that
vocabulary: ids are mapped to the target's with `to_target_ids` and q to the target's vocabulary with
`to_target_vocab`, zero elsewhere. The tokens it leaves out cost acceptance, not exactness: the
verifier's residual max(p - q, 0) still covers them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from minispec.dflash.model import DFlashCache, DFlashDraftModel
from minispec.speculative import sampling as smp
from minispec.speculative.batch import PromptBatch
from minispec.speculative.drafter import Proposal, Sampling
from minispec.speculative.output import TargetOutput

POLICIES = ("argmax", "sample")


class DFlashDrafter:
    needs_hidden_states = True

    def __init__(self, model: DFlashDraftModel, target, num_draft_tokens: int | None = None,
                 block_size: int | None = None, policy: str = "argmax"):
        cfg = model.config
        if block_size is not None and block_size != cfg.block_size:
            raise ValueError(f"block_size {block_size} differs from the drafter's config ({cfg.block_size}): a DFlash "
                             "drafter runs the block size it was trained with")
        if policy not in POLICIES:
            raise ValueError(f"unknown drafting policy {policy!r}: expected one of {', '.join(map(repr, POLICIES))}")
        model.attach_target(target)
        self.model = model.eval()
        self.policy = policy
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.vocab_size = cfg.vocab_size  # the target's: drafts and q are given in its ids
        self.num_draft_tokens = self.block_size - 1 if num_draft_tokens is None else num_draft_tokens
        self._check_k(self.num_draft_tokens)
        self.cache: DFlashCache | None = None
        self.last_logits: torch.Tensor | None = None  # [B, T, Vd] of the latest block, for visualizations

    @classmethod
    def from_pretrained(cls, folder, target, **kwargs) -> DFlashDrafter:
        """Load a drafter saved with `save_pretrained` or exported in the HF-native DFlash format; it computes
        in the target's dtype (weights are stored in bf16, and bf16 matmuls are slow on most CPUs). `kwargs`
        are the constructor's (`num_draft_tokens`, `policy`)."""
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
        logits = self.last_logits[:, 1: 1 + k]  # [B, K, Vd]: block position k proposes token k
        if self.policy == "argmax" or sampling.greedy:
            return Proposal(self.model.to_target_ids(smp.greedy(logits)).to(last.device), q=None)
        q = sampling.probs(logits)  # [B, K, Vd]
        drafts = self.model.to_target_ids(smp.sample(q, generator))
        return Proposal(drafts.to(last.device), q=self.model.to_target_vocab(q).to(last.device))

    @torch.no_grad()
    def commit(self, accepted: torch.Tensor, tokens: torch.Tensor, target_out: TargetOutput) -> None:
        features = self.model.tap(target_out.hidden_states)  # over [last, d_1 .. d_K]
        n = features.shape[1]
        keep = torch.arange(n, device=features.device)[None, :] < (accepted.to(features.device) + 1)[:, None]
        self.model.extend_cache(self.cache, features, keep)
