"""What one target forward hands the decoding loops and the drafters (`TargetOutput`).

Its own module because every kind of target produces it: the adapters in `minispec.speculative.target`
and minispec's own hybrid model (`minispec.ssm.hybrid`), which those adapters drive in turn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, n, V] at the n positions just fed ([B, 1, V] after a prefill)
    hidden_states: tuple[torch.Tensor, ...] | None  # per layer (0 = embeddings) [B, n, H], when asked for
