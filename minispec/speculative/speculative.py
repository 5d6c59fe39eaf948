"""The speculative decoding loop: draft K tokens, verify them in one target forward, repeat.

    last = sample(target(prompt))                      # the first token, as in plain decoding
    repeat:
        d_1..d_K, q = drafter.propose(last)
        p_1..p_{K+1} = target([last, d_1..d_K])        # one forward, K+1 distributions
        a, tokens = verify(d, p, q)                     # exact: output ~ target's distribution
        roll the target's cache back to [.., last, d_1..d_a]; last = tokens[a]

τ (tokens per target forward) is what makes this pay: each cycle costs one target forward plus
the drafting, and emits a + 1 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minispec.speculative import sampling as smp
from minispec.speculative.autoregressive import Generation, check_generation_args
from minispec.speculative.drafter import Drafter, Sampling, check_drafter, check_num_draft_tokens
from minispec.speculative.stats import ACCEPTED, BONUS, CORRECTION, REJECTED, CycleRecord, SpecStats, Token
from minispec.speculative.target import target_adapter
from minispec.speculative.verify import verify


@dataclass
class SpecGeneration(Generation):
    stats: SpecStats = field(default_factory=SpecStats)


def cycle_records(cycle: int, active: list[int], drafts, lengths, p, q, res, emitted) -> list[CycleRecord]:
    """Per active sequence, the tokens of this cycle with their fate and their p and q."""
    records = []
    for b in active:
        a, K_b = int(res.accepted[b]), int(lengths[b])
        toks = []
        for k in range(K_b):
            d = int(drafts[b, k])
            toks.append(Token(d, ACCEPTED if k < a else REJECTED, float(p[b, k, d]),
                              1.0 if q is None else float(q[b, k, d])))
        last = int(res.tokens[b, a])
        toks.append(Token(last, BONUS if a == K_b else CORRECTION, float(p[b, a, last])))
        records.append(CycleRecord(cycle, b, K_b, a, toks, emitted[b]))
    return records


def report(stats: SpecStats, on_cycle, records: list[CycleRecord]) -> None:
    stats.cycles.extend(records)
    if on_cycle is not None:
        for r in records:
            on_cycle(r)


@torch.no_grad()
def speculative_generate(target, drafter: Drafter, input_ids, max_new_tokens: int, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None, on_cycle=None,
                         num_draft_tokens: int | None = None) -> SpecGeneration:
    """Generate with `drafter` proposing and `target` verifying; output is distributed exactly as
    `autoregressive_generate(target, ...)` (token for token equal at temperature 0).

    At temperature 0 no random number is drawn: the global RNG and `generator` are left as they were, as
    plain greedy decoding leaves them. Arguments are checked before any work (`check_generation_args`,
    `check_drafter`); a target that cannot be rolled back (`check_speculative`) is refused up front.
    """
    args = check_generation_args(target, input_ids, max_new_tokens, temperature, top_k, top_p, generator)
    batch, pad_id, eos_id = args.batch, args.pad_id, args.eos_id
    check_drafter(drafter, target.config.vocab_size)
    K = drafter.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    check_num_draft_tokens(K)
    if on_cycle is not None and not callable(on_cycle):
        raise TypeError(f"on_cycle must be a function of one CycleRecord, or None, got {type(on_cycle).__name__}")
    sampling = Sampling(temperature, top_k, top_p)
    B = batch.size

    tgt = target_adapter(target, output_hidden_states=drafter.needs_hidden_states)
    tgt.check_speculative(batch)
    out = tgt.prefill(batch)
    drafter.begin(batch, out)
    last = smp.next_token(out.logits[:, -1], temperature, top_k, top_p, generator)
    outputs = [[int(t)] for t in last]
    done = [max_new_tokens == 1 or (eos_id is not None and int(t) == eos_id) for t in last]
    stats = SpecStats()
    p_first = smp.sampling_probs(out.logits[:, -1], temperature, top_k, top_p)
    report(stats, on_cycle, [CycleRecord(0, b, 0, 0, [Token(int(t), CORRECTION, float(p_first[b, t]))], [int(t)])
                             for b, t in enumerate(last)])

    cycle = 1
    while not all(done):
        prop = drafter.propose(last, K, sampling, generator)
        lengths = prop.lengths if prop.lengths is not None else torch.full((B,), K)
        out = tgt.forward(torch.cat([last[:, None], prop.tokens], dim=1))
        p = smp.sampling_probs(out.logits, temperature, top_k, top_p)
        # At T = 0 p is one-hot at the target's argmax, so whatever the uniform u in (0, 1] a draft is accepted
        # iff it is that argmax, and the correction or bonus is that argmax: u = 1 draws no random number,
        # which leaves `generator` and the global RNG as plain greedy decoding leaves them.
        uniforms = torch.ones(B, K + 1, device=p.device) if temperature == 0 else None
        res = verify(prop.tokens, p, prop.q, uniforms, draft_lengths=lengths, eos_token_id=eos_id, generator=generator)
        tgt.rollback(res.accepted + 1, K + 1)
        drafter.commit(res.accepted, res.tokens, out)

        active = [b for b in range(B) if not done[b]]
        emitted = {}
        for b in active:
            room = max_new_tokens - len(outputs[b])
            emitted[b] = res.tokens[b, : min(int(res.num_emitted[b]), room)].tolist()
            outputs[b].extend(emitted[b])
            done[b] = len(outputs[b]) >= max_new_tokens or (eos_id is not None and eos_id in emitted[b])
        report(stats, on_cycle, cycle_records(cycle, active, prop.tokens, lengths, p, prop.q, res, emitted))
        last = res.tokens.gather(1, res.accepted[:, None]).squeeze(1)
        cycle += 1

    n = max(len(o) for o in outputs)
    tokens = torch.full((B, n), pad_id, dtype=torch.long)
    for b, o in enumerate(outputs):
        tokens[b, : len(o)] = torch.tensor(o)
    return SpecGeneration(tokens, torch.tensor([len(o) for o in outputs]), stats)
