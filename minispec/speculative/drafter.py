"""The one small protocol every drafter implements, so one loop can drive them all.

    begin(batch, target_out)         the prompt, and the target's prefill outputs over it
    propose(last, k, sampling, gen)  K draft tokens after `last` (the newest emitted token),
                                     with their draft distributions q, or None for argmax drafts
    commit(accepted, tokens, target_out)
                                     how many drafts each sequence accepted, the tokens it
                                     emitted (accepted drafts, then the correction or bonus), and
                                     the target's outputs over [last, d_1 .. d_K]
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Protocol

import torch

from minispec.speculative.batch import PromptBatch
from minispec.speculative.output import TargetOutput
from minispec.speculative.sampling import Sampling

__all__ = ["Drafter", "Proposal", "Sampling", "check_drafter", "check_num_draft_tokens"]


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, K] draft tokens
    q: torch.Tensor | None = None  # [B, K, V] the distributions they were sampled from; None = argmax drafts
    lengths: torch.Tensor | None = None  # [B] row b proposes only its first lengths[b] tokens (ragged)


class Drafter(Protocol):
    vocab_size: int
    num_draft_tokens: int  # K used when the caller does not choose
    needs_hidden_states: bool  # ask the target for per-layer hidden states (DFlash taps, MTP)

    def begin(self, batch: PromptBatch, target_out: TargetOutput) -> None: ...

    def propose(self, last: torch.Tensor, k: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal: ...

    def commit(self, accepted: torch.Tensor, tokens: torch.Tensor, target_out: TargetOutput) -> None: ...


def check_num_draft_tokens(k) -> None:
    """TypeError / ValueError unless K, the number of draft tokens per cycle, is an int >= 1 (not a bool)."""
    if isinstance(k, bool) or not isinstance(k, Integral):
        raise TypeError(f"the number of draft tokens K must be an int >= 1, got {type(k).__name__} {k!r}")
    if k < 1:
        raise ValueError(f"the number of draft tokens K must be an int >= 1, got {k!r}")


def check_drafter(drafter, vocab_size: int) -> None:
    """TypeError unless `drafter` implements the protocol above; ValueError unless it drafts in the target's
    vocabulary of `vocab_size` ids."""
    missing = [name for name in ("vocab_size", "num_draft_tokens", "needs_hidden_states", "begin", "propose", "commit")
               if not hasattr(drafter, name)]
    if missing:
        hint = f": load it first, ms.load_drafter({drafter!r}, target)" if isinstance(drafter, str) else ""
        raise TypeError(f"the drafter must implement minispec.speculative.drafter.Drafter (missing "
                        f"{', '.join(missing)}), "
                        f"got {type(drafter).__name__}{hint}")
    if drafter.vocab_size != vocab_size:
        raise ValueError(f"drafter vocab size {drafter.vocab_size} != target vocab size {vocab_size}: "
                         "drafter and target must share one tokenizer")
