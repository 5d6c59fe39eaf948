"""`MTPDrafter`: the MTP head behind the speculative loop's drafter protocol.

Slots. The head's position s pairs the backbone's hidden state h_s with the token x_{s+1} after it and
predicts x_{s+2}. After a prompt x_0 .. x_{n-1} the target has h_0 .. h_{n-1} and samples `last` = x_n.

    begin(prompt, prefill)     slots 0 .. n-2 (h_s, x_{s+1}) enter the head's cache; h_{n-1} waits
    propose(last, K)           depth 1: (h_{n-1}, last) at slot n-1 -> d_1; depth k: (out_{k-1}, d_{k-1})
                               at slot n+k-2 -> d_k. The depth-k entries are tentative.
    commit(a, tokens, verify)  slots n-1 .. n-1+a are rewritten from the backbone's own hidden states,
                               (h_{n-1}, last), (h_n, d_1), .. (h_{n+a-1}, d_a); h_{n+a} waits for the next
                               `last` (the correction or bonus token)

So the cache only ever holds entries built from backbone hidden states, and the head's own outputs are
used only inside one propose, as at serving time in vLLM and SGLang.

Drafts are sampled from the head's distribution q (same temperature / top-k / top-p as the target) and
verified with the full q, or, with `argmax_drafts=True` (and always at temperature 0), the head's argmax
with q one-hot. Both are exact.
"""
from __future__ import annotations

from pathlib import Path

import torch

from minispec.mtp.backbone import Backbone, check_head_fits
from minispec.mtp.head import MTPCache, MTPHead
from minispec.speculative import sampling as smp
from minispec.speculative.batch import PromptBatch
from minispec.speculative.drafter import Proposal, Sampling
from minispec.speculative.output import TargetOutput


def check_k(k) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"an MTP head drafts K >= 1 tokens (one per recursive call), got K={k!r}")


class MTPDrafter:
    needs_hidden_states = True

    def __init__(self, head: MTPHead, backbone_model, num_draft_tokens: int = 3, argmax_drafts: bool = False):
        check_k(num_draft_tokens)
        self.backbone = backbone_model if isinstance(backbone_model, Backbone) else Backbone.of(backbone_model)
        check_head_fits(head, self.backbone)
        self.head = head.eval()
        self.vocab_size = head.config.vocab_size
        self.num_draft_tokens = num_draft_tokens
        self.argmax_drafts = argmax_drafts
        self.cache: MTPCache | None = None
        self.pending: torch.Tensor | None = None  # [B, H] the hidden state that waits for `last`
        self._last: torch.Tensor | None = None

    @classmethod
    def beside(cls, target, num_draft_tokens: int = 3, argmax_drafts: bool = False) -> MTPDrafter:
        """The MTP head shipped beside `target`'s weights (`mtp_config.json` + `mtp.safetensors`, weights
        named `mtp.*` in the target's folder), as vLLM's `method: "mtp"` reads the target checkpoint's
        own MTP layers."""
        folder = Path(getattr(target.config, "name_or_path", "") or ".")
        if not (folder / "mtp.safetensors").exists():
            raise ValueError(f"the target has no MTP head beside its weights: {folder / 'mtp.safetensors'} is "
                             "missing (the target must be loaded from a folder that holds mtp_config.json and "
                             "mtp.safetensors, e.g. HybridLM.from_pretrained(\"lightning-mini\"))")
        head = MTPHead.from_pretrained(folder, dtype=target.dtype)
        return cls(head, target, num_draft_tokens, argmax_drafts)

    def _depth(self, hidden, tokens, valid, slots):
        """hidden [B, T, H], tokens [B, T] (the token after each hidden state) -> head out [B, T, H]."""
        return self.head(hidden, self.backbone.embed(tokens), valid, self.cache, slots)

    @torch.no_grad()
    def begin(self, batch: PromptBatch, target_out: TargetOutput) -> None:
        hidden = Backbone.hidden(target_out)  # [B, n, H], left-padded like the prompt
        B, n = batch.input_ids.shape
        self.cache = MTPCache(B, hidden.device, capacity=max(64, 2 * n))
        if n > 1:
            slots = torch.arange(n - 1, device=hidden.device).expand(B, -1)
            self._depth(hidden[:, :-1], batch.input_ids[:, 1:], batch.attention_mask[:, :-1].bool(), slots)
        self.cache.length = torch.full((B,), n - 1, dtype=torch.long, device=hidden.device)
        self.pending = hidden[:, -1]

    @torch.no_grad()
    def propose(self, last: torch.Tensor, k: int, sampling: Sampling, generator=None) -> Proposal:
        check_k(k)
        greedy = self.argmax_drafts or sampling.greedy
        self._last = last
        B = last.shape[0]
        valid = torch.ones(B, 1, dtype=torch.bool, device=last.device)
        hidden, token = self.pending[:, None], last[:, None]
        drafts, qs = [], []
        for depth in range(k):
            out = self._depth(hidden, token, valid, (self.cache.length + depth)[:, None])
            logits = self.backbone.logits(out)[:, -1]
            q = sampling.probs(logits)
            d = smp.greedy(logits) if greedy else smp.sample(q, generator)
            drafts.append(d)
            qs.append(q)
            hidden, token = out, d[:, None]
        return Proposal(torch.stack(drafts, dim=1), None if greedy else torch.stack(qs, dim=1))

    @torch.no_grad()
    def commit(self, accepted: torch.Tensor, tokens: torch.Tensor, target_out: TargetOutput) -> None:
        verify_hidden = Backbone.hidden(target_out)  # [B, K+1, H] over [last, d_1 .. d_K]
        B, n = verify_hidden.shape[:2]
        accepted = accepted.to(verify_hidden.device)
        # Rows are (h_{n-1}, last), (h_n, d_1), ... : the accepted drafts are tokens[:, :a].
        hidden = torch.cat([self.pending[:, None], verify_hidden[:, :-1]], dim=1)
        nexts = torch.cat([self._last[:, None], tokens[:, : n - 1].to(self._last.device)], dim=1)
        steps = torch.arange(n, device=hidden.device)
        keep = steps[None, :] <= accepted[:, None]  # a + 1 entries per row; the rest are never visible
        nexts = nexts.masked_fill(~keep, 0)  # past the correction, the loop's tokens are padding (-1)
        self._depth(hidden, nexts, keep, self.cache.length[:, None] + steps[None, :])
        self.cache.length = self.cache.length + accepted + 1
        self.pending = verify_hidden[torch.arange(B, device=hidden.device), accepted]
