"""What one verification cycle did, and the acceptance statistics the papers report.

τ (tau, "acceptance length") is counted as the papers count it: tokens emitted per target forward,
i.e. accepted drafts + 1 (the target's correction or bonus token), averaged over verification cycles.
A run that ended on its first token (EOS straight from the prefill, or max_new_tokens = 1) verified
nothing; its τ is 1.0, plain decoding's one token per forward, never NaN. To average over runs, merge
their cycles (`SpecStats([c for r in runs for c in r.stats.cycles])`): that weights each run by its
verifications, and a run without any adds nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ACCEPTED, REJECTED, CORRECTION, BONUS = "accepted", "rejected", "correction", "bonus"


@dataclass
class Token:
    id: int
    status: str  # ACCEPTED / REJECTED (a discarded draft) / CORRECTION / BONUS
    p: float | None = None  # target probability of this token at its position (drafts only)
    q: float | None = None  # draft probability (1.0 for a deterministic, argmax draft)


@dataclass
class CycleRecord:
    """One target forward of one sequence: what `on_cycle` receives, one per sequence.

    Cycle 0 is the prefill: no drafts (`proposed == 0`), one token sampled by the target. Cycles 1, 2, ...
    are verifications. The statistics below count verifications only, as the papers do.
    """
    cycle: int  # 0 = prefill, then 1, 2, ... one per verification
    sequence: int  # index in the batch
    proposed: int  # K, drafts proposed this cycle
    accepted: int  # drafts accepted (0..K)
    tokens: list[Token]  # drafts (accepted then rejected) followed by the correction / bonus token
    emitted: list[int]  # ids appended to the output this cycle (cut at EOS / max_new_tokens)

    @property
    def last_kind(self) -> str:
        return BONUS if self.accepted == self.proposed else CORRECTION


@dataclass
class SpecStats:
    cycles: list[CycleRecord] = field(default_factory=list)  # every record, prefill included

    @property
    def verifications(self) -> list[CycleRecord]:
        return [c for c in self.cycles if c.proposed > 0]

    @property
    def tau(self) -> float:
        """Mean accepted drafts + 1 per verification cycle; 1.0 without any verification (the run's one
        target forward, its prefill, emitted one token, as in plain decoding)."""
        v = self.verifications
        if not v:
            return 1.0
        return sum(c.accepted + 1 for c in v) / len(v)

    @property
    def max_proposed(self) -> int:
        return max((c.proposed for c in self.cycles), default=0)

    @property
    def per_position(self) -> torch.Tensor:
        """`[K]`: acceptance rate of draft position k = 1..K, conditioned on reaching position k
        (position k is reached when drafts 1..k-1 were all accepted)."""
        K = self.max_proposed
        reached, accepted = torch.zeros(K), torch.zeros(K)
        for c in self.verifications:
            reach = min(c.accepted + 1, c.proposed)
            reached[:reach] += 1
            accepted[: c.accepted] += 1
        return accepted / reached.clamp(min=1)

    @property
    def histogram(self) -> torch.Tensor:
        """`[K + 2]`: number of cycles that emitted n tokens (accepted + 1), n = 0..K+1."""
        h = torch.zeros(self.max_proposed + 2, dtype=torch.long)
        for c in self.verifications:
            h[c.accepted + 1] += 1
        return h
