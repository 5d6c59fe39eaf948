"""`python -m minispec.bench mtp`: AR vs MTP speculative decoding on lightning-mini, in one run.

The head is the one shipped beside the backbone (`mtp_config.json` + `mtp.safetensors` in the
lightning-mini folder). Batch 1, the replay Mamba-state strategy, the frozen eval prompts. Per
temperature and K: tokens/s, τ (tokens per target forward, i.e. AL), the ratio to AR, the per-position
acceptance, and at T = 0 whether the output equals AR token for token. The AR baseline is greedy
plain decoding with the model's own cache at every temperature (its cost per token does not depend on
how the token is chosen).

Then the cost of one boosting step (backbone forward, the head's depths, backward, AdamW) per context a
depth can read (minispec.mtp.boost): unrolled, hidden-state mixing, and the stitched context of test-time
training, on the same batch.
"""
from __future__ import annotations

from functools import partial

import torch

from minispec.bench.timing import timed
from minispec.mtp.drafter import MTPDrafter
from minispec.mtp.head import MTPHead
from minispec.speculative.stats import SpecStats

KS = (3, 7)


def speed_rows(model, head: MTPHead, prompts: list[torch.Tensor], max_new_tokens: int, ks=KS,
               temperatures=(0.0, 1.0), seed: int = 0) -> list[dict]:
    """AR and MTP speculative decoding of each prompt (batch 1) on a HybridLM `model`."""
    import minispec as ms

    ar_s, ar = timed(lambda: [ms.autoregressive_generate(model, p, max_new_tokens) for p in prompts], 1)
    n_ar = sum(int(a.lengths.sum()) for a in ar)
    rows = [{"method": "autoregressive", "T": "-", "K": 0, "tau": 1.0, "tokens_per_s": round(n_ar / ar_s, 1),
             "speedup": 1.0, "per_position": "-", "equal_to_ar": True}]
    for temperature in temperatures:
        for k in ks:
            drafter = MTPDrafter(head, model, num_draft_tokens=k)

            def spec(drafter=drafter, temperature=temperature):
                generator = torch.Generator().manual_seed(seed)
                return [ms.speculative_generate(model, drafter, p, max_new_tokens, temperature=temperature,
                                                generator=generator) for p in prompts]

            s, outs = timed(spec, 1)
            n = sum(int(o.lengths.sum()) for o in outs)
            stats = SpecStats([c for o in outs for c in o.stats.cycles])
            equal = (all(torch.equal(o.tokens, a.tokens) for o, a in zip(outs, ar))
                     if temperature == 0 else "-")
            rows.append({"method": "MTP speculative", "T": temperature, "K": k,
                         "tau": round(stats.tau, 3),
                         "tokens_per_s": round(n / s, 1), "speedup": round((n / s) / (n_ar / ar_s), 3),
                         "per_position": " ".join(f"{x:.2f}" for x in stats.per_position.tolist()),
                         "equal_to_ar": equal})
    return rows


def training_step_rows(model, head: MTPHead, input_ids: torch.Tensor, depths: int = 3, repeats: int = 3) -> list[dict]:
    """Seconds per boosting step on input_ids [B, S] for each context, and the ratio to unrolled training.
    The head's weights are restored after timing (each timed step updates them)."""
    from minispec.mtp.backbone import Backbone
    from minispec.mtp.boost import CONTEXTS, boost_loss

    backbone = Backbone.of(model)
    start = {k: v.clone() for k, v in head.state_dict().items()}
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    head.train()

    def step(context):
        generator = torch.Generator().manual_seed(0)
        res = boost_loss(head, backbone, input_ids, depths, context=context, generator=generator)
        res.loss.backward()
        opt.step()
        opt.zero_grad()

    seconds = {context: timed(partial(step, context), repeats)[0] for context in CONTEXTS}
    head.load_state_dict(start)
    head.eval()
    B, S = input_ids.shape
    return [{"boosting step": context, "batch x tokens": f"{B} x {S}", "depths": depths,
             "ms_per_step": round(1000 * s, 1), "vs_unrolled": round(s / seconds["unrolled"], 2)}
            for context, s in seconds.items()]


def bench_mtp(args) -> list[dict]:
    import minispec as ms
    from minispec.ssm.hybrid import HybridLM

    model = HybridLM.from_pretrained("lightning-mini")
    head = MTPDrafter.beside(model).head
    prompts = ms.load_evalset().prompts[: args.prompts]
    rows = speed_rows(model, head, prompts, args.max_new_tokens, temperatures=tuple(args.temperatures))
    batch = torch.stack([p[:64] for p in ms.load_evalset().prompts[:8]])  # eval prompts hold >= 64 tokens
    return rows + training_step_rows(model, head, batch, repeats=args.repeats)
