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

from minispec.speculative.autoregressive import Generation, check_generation_args
from minispec.speculative.drafter import Drafter, Sampling, check_drafter, check_num_draft_tokens
from minispec.speculative.stats import Recorder, SpecStats
from minispec.speculative.target import target_adapter
from minispec.speculative.verify import verify


@dataclass
class SpecGeneration(Generation):
    stats: SpecStats = field(default_factory=SpecStats)


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
    `on_cycle(record)` sees each `CycleRecord` as it happens (`Recorder`).
    """
    args = check_generation_args(target, input_ids, max_new_tokens, temperature, top_k, top_p, generator)
    batch, pad_id, eos_id = args.batch, args.pad_id, args.eos_id
    check_drafter(drafter, target.config.vocab_size)
    K = drafter.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    check_num_draft_tokens(K)
    sampling = Sampling(temperature, top_k, top_p)
    record = Recorder(on_cycle)
    B = batch.size

    tgt = target_adapter(target, output_hidden_states=drafter.needs_hidden_states)
    tgt.check_speculative(batch)
    out = tgt.prefill(batch)
    drafter.begin(batch, out)
    last = sampling.next_token(out.logits[:, -1], generator)
    record.prefill(last, sampling.probs(out.logits[:, -1]))
    outputs = [[int(t)] for t in last]
    done = [max_new_tokens == 1 or (eos_id is not None and int(t) == eos_id) for t in last]

    while not all(done):
        prop = drafter.propose(last, K, sampling, generator)
        lengths = prop.lengths if prop.lengths is not None else torch.full((B,), K)
        out = tgt.forward(torch.cat([last[:, None], prop.tokens], dim=1))
        p = sampling.probs(out.logits)
        # At T = 0 p is one-hot at the target's argmax, so whatever the uniform u in (0, 1] a draft is accepted
        # iff it is that argmax, and the correction or bonus is that argmax: u = 1 draws no random number,
        # which leaves `generator` and the global RNG as plain greedy decoding leaves them.
        uniforms = torch.ones(B, K + 1, device=p.device) if sampling.greedy else None
        res = verify(prop.tokens, p, prop.q, uniforms, draft_lengths=lengths, eos_token_id=eos_id, generator=generator)
        tgt.rollback(res.accepted + 1, K + 1)
        drafter.commit(res.accepted, res.tokens, out)

        emitted = {}
        for b in [b for b in range(B) if not done[b]]:
            room = max_new_tokens - len(outputs[b])
            emitted[b] = res.tokens[b, : min(int(res.num_emitted[b]), room)].tolist()
            outputs[b].extend(emitted[b])
            done[b] = len(outputs[b]) >= max_new_tokens or (eos_id is not None and eos_id in emitted[b])
        record.cycle(prop.tokens, lengths, p, prop.q, res, emitted)
        last = res.tokens.gather(1, res.accepted[:, None]).squeeze(1)

    n = max(len(o) for o in outputs)
    tokens = torch.full((B, n), pad_id, dtype=torch.long)
    for b, o in enumerate(outputs):
        tokens[b, : len(o)] = torch.tensor(o)
    return SpecGeneration(tokens, torch.tensor([len(o) for o in outputs]), record.stats)
