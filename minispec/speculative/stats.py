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


class Recorder:
    """What the speculative loop reports, kept apart from the algorithm: every `CycleRecord` into `stats`, and
    each one handed to `on_cycle` (a notebook's live view hooks in here) as it happens."""

    def __init__(self, on_cycle=None):
        if on_cycle is not None and not callable(on_cycle):
            raise TypeError(f"on_cycle must be a function of one CycleRecord, or None, got {type(on_cycle).__name__}")
        self.on_cycle = on_cycle
        self.stats = SpecStats()
        self.cycles = 0

    def _report(self, records: list[CycleRecord]) -> None:
        self.stats.cycles.extend(records)
        if self.on_cycle is not None:
            for r in records:
                self.on_cycle(r)

    def prefill(self, first: torch.Tensor, p: torch.Tensor) -> None:
        """Cycle 0: the token [B] each sequence sampled from the prefill's distributions p [B, V]."""
        self._report([CycleRecord(0, b, 0, 0, [Token(int(t), CORRECTION, float(p[b, t]))], [int(t)])
                      for b, t in enumerate(first)])

    def cycle(self, drafts: torch.Tensor, lengths: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, res,
              emitted: dict[int, list[int]]) -> None:
        """One verification: drafts [B, K] (row b proposed lengths[b]), the target's p [B, K+1, V] and the
        drafts' q [B, K, V] (None: argmax drafts), `verify`'s result, and what each still-active sequence b
        emitted (`emitted[b]`). Each token is recorded with its fate and its p and q."""
        self.cycles += 1
        records = []
        for b, out in emitted.items():
            a, K_b = int(res.accepted[b]), int(lengths[b])
            tokens = []
            for k in range(K_b):
                d = int(drafts[b, k])
                tokens.append(Token(d, ACCEPTED if k < a else REJECTED, float(p[b, k, d]),
                                    1.0 if q is None else float(q[b, k, d])))
            last = int(res.tokens[b, a])
            tokens.append(Token(last, BONUS if a == K_b else CORRECTION, float(p[b, a, last])))
            records.append(CycleRecord(self.cycles, b, K_b, a, tokens, out))
        self._report(records)
