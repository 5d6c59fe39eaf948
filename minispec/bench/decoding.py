"""Autoregressive and speculative decoding on a Hugging Face target (`python -m minispec.bench ar | spec`),
and the cost model's parts timed in isolation, which every drafter bench checks its prediction with.

The speedup formula of "Nemotron 3.5 Bolt E4B: block-parallel speculation with DFlash"
(`minispec.costs.speedup`): speedup = tau * C_t / (C_d + C_v). `isolated_costs` times each part alone,
at batch 1 after one representative context, never from a speculative run:

    C_t   one plain decode step: the target's forward over one token, after the context (prefilled KV cache)
    C_v   one verify step: the target's forward over K + 1 tokens at the same context, and the rollback
          of the entries a cycle drops
    C_d   one drafter cycle: propose K drafts, then commit a verify forward's outputs, on the drafter's own
          state built from the same context

so the predicted speedup is a prediction that can miss. What it leaves out shows up as the gap between
the measured wall time per target forward and C_t (plain decoding) or C_d + C_v (speculative): the
decoding loop's own work (sampling, verification, bookkeeping) and the prefills.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch

import minispec as ms
from minispec import costs
from minispec.bench.timing import timed
from minispec.speculative.autoregressive import special_ids
from minispec.speculative.batch import as_prompt_batch
from minispec.speculative.drafter import Sampling
from minispec.speculative.stats import SpecStats
from minispec.speculative.target import target_adapter


def bench_prompts(tokenizer) -> list[torch.Tensor]:
    """What a target is benchmarked on: MT-Bench's 80 first turns for a chat model (its tokenizer has a
    chat template, e.g. smollm2-135m), the frozen stdlib eval set otherwise (bolt-mini)."""
    if tokenizer.chat_template is not None:
        return ms.load_mtbench(tokenizer).prompts
    return ms.load_evalset().prompts


def tuning_prompts(target_name: str, tokenizer, n: int) -> list[torch.Tensor]:
    """What a setting is chosen on, never the benchmark prompts: the first `n` held-out ShareGPT prompts of the
    target's reply set (`minispec.dflash.data`) for a chat model, `n` windows of 128 tokens from the stdlib's
    validation split for bolt-mini (its benchmark is the test split)."""
    from minispec.dflash.data import DATASETS, heldout_prompts
    from minispec.targets import data

    folder = DATASETS / f"{target_name}-sharegpt"
    if folder.is_dir():
        return heldout_prompts(folder, n)
    if tokenizer.chat_template is not None:
        raise ValueError(f"no held-out prompts for {target_name!r}: its reply set {folder} does not exist (make it "
                         f"with `python -m minispec.dflash.data --target {target_name}`)")
    return list(data.random_windows(data.token_stream("val", tokenizer), n, 128, seed=0, step=-11))


def representative_context(prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """[L] the prompt and the first half of its continuation: the mean context length of a decode."""
    return torch.cat([prompt, continuation[: len(continuation) // 2]])


@dataclass(frozen=True)
class CycleCosts:
    """The cost model's parts in seconds, each timed alone (see the module docstring)."""
    c_t: float
    c_d: float
    c_v: float

    def columns(self, tau: float, seconds_per_forward: float) -> dict:
        """C_t, C_d, C_v, the predicted speedup at `tau`, and the measured wall time per target forward with
        the part of it the isolated costs do not explain (the loop's overhead)."""
        return {"C_t_ms": round(1000 * self.c_t, 2), "C_d_ms": round(1000 * self.c_d, 3),
                "C_v_ms": round(1000 * self.c_v, 2),
                "predicted_speedup": round(costs.speedup(tau, self.c_t, self.c_d, self.c_v), 3),
                "cycle_ms": round(1000 * seconds_per_forward, 2),
                "overhead_ms": round(1000 * (seconds_per_forward - self.c_d - self.c_v), 2)}


@torch.no_grad()
def decode_step_cost(target, context: torch.Tensor, repeats: int = 5) -> float:
    """C_t: seconds of one plain decode step after `context` [L], batch 1, best of `repeats` (each timed call
    keeps its token, as decoding does: the context grows by a few tokens in all)."""
    plain = target_adapter(target)
    last = plain.prefill(as_prompt_batch(context[None], special_ids(target)[0])).logits[:, -1].argmax(dim=-1)
    return timed(lambda: plain.extend(last[:, None]), repeats)[0]


GREEDY = Sampling()


@torch.no_grad()
def isolated_costs(target, drafter, context: torch.Tensor, sampling: Sampling = GREEDY, repeats: int = 5,
                   seed: int = 0, c_t: float | None = None) -> CycleCosts:
    """C_t, C_d and C_v of `drafter` (any drafter of the loop's protocol) on `target` after `context` [L],
    batch 1, each the best of `repeats` calls of `timed` on its own prefilled state. C_t depends on the target
    and the context only: pass `c_t` to give every drafter compared the same one.

    Each timed verify step and drafter cycle keeps what a cycle that accepts nothing keeps (one token), so
    the context grows by one token per call: a few tokens in all.
    """
    K = drafter.num_draft_tokens
    batch = as_prompt_batch(context[None], special_ids(target)[0])
    verifier = target_adapter(target, output_hidden_states=drafter.needs_hidden_states)
    prefill = verifier.prefill(batch)
    last = prefill.logits[:, -1].argmax(dim=-1)  # [1]
    drafter.begin(batch, prefill)
    generator = torch.Generator().manual_seed(seed)
    window = torch.cat([last[:, None], drafter.propose(last, K, sampling, generator).tokens], dim=1)  # [1, K+1]
    keep_last, accept_none = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)

    def verify_step():
        out = verifier.forward(window)
        verifier.rollback(keep_last, K + 1)
        return out

    c_v, verify_out = timed(verify_step, repeats)

    def draft_cycle():
        drafter.propose(last, K, sampling, generator)
        drafter.commit(accept_none, window, verify_out)

    c_d, _ = timed(draft_cycle, repeats)
    return CycleCosts(decode_step_cost(target, context, repeats) if c_t is None else c_t, c_d, c_v)


def plain_decoding_costs(target, context: torch.Tensor, repeats: int = 5) -> CycleCosts:
    """Plain decoding in the cost model's terms: no drafts (C_d = 0), and a "verify" of the one new token
    (C_v = C_t), so its predicted speedup is 1 and the gap to its wall time is its loop's overhead."""
    c_t = decode_step_cost(target, context, repeats)
    return CycleCosts(c_t, 0.0, c_t)


def bench_ar(args) -> list[dict]:
    """Autoregressive tokens/s of a target at several batch sizes, on its benchmark prompts."""
    model, tokenizer = ms.load_target(args.target)
    prompts = bench_prompts(tokenizer)
    rows = []
    for batch in args.batch:
        chosen = prompts[:batch]
        seconds, out = timed(partial(ms.autoregressive_generate, model, chosen, args.max_new_tokens), args.repeats)
        n = int(out.lengths.sum())
        rows.append({"model": args.target, "batch": batch, "new_tokens": n, "seconds": round(seconds, 4),
                     "tokens_per_s": round(n / seconds, 1),
                     "ms_per_forward": round(1000 * seconds / int(out.lengths.max()), 2)})
    return rows


def bench_spec(args) -> list[dict]:
    """AR and speculative decoding with each drafter on the same prompts, batch 1, in one run; each drafter's
    measured speedup beside the cost model's prediction from its isolated costs."""
    model, tokenizer = ms.load_target(args.target)
    prompts = bench_prompts(tokenizer)[: args.prompts]

    def run_all(generate):
        outs = [generate(p) for p in prompts]
        return outs, sum(int(o.lengths.sum()) for o in outs)

    ar_s, (ar_outs, ar_n) = timed(lambda: run_all(lambda p: ms.autoregressive_generate(
        model, p, args.max_new_tokens, temperature=args.temperature, generator=torch.Generator().manual_seed(0))),
        args.repeats)
    context = representative_context(prompts[0], ar_outs[0].tokens[0, : int(ar_outs[0].lengths[0])])
    repeats = max(args.repeats, 3)
    plain = plain_decoding_costs(model, context, repeats)
    rows = [{"method": "autoregressive", "drafter": "-", "K": 0, "tau": 1.0, "tokens_per_s": round(ar_n / ar_s, 1),
             "speedup": 1.0, **plain.columns(1.0, ar_s / ar_n)}]
    for name in args.drafters:
        drafter = ms.load_drafter(name, model)

        def spec(p, drafter=drafter):
            return ms.speculative_generate(model, drafter, p, args.max_new_tokens, temperature=args.temperature,
                                           generator=torch.Generator().manual_seed(0))

        seconds, (outs, n) = timed(lambda: run_all(spec), args.repeats)
        stats = SpecStats([c for o in outs for c in o.stats.cycles])
        forwards = len(stats.verifications) + len(prompts)  # a prefill per prompt, then one per cycle
        parts = isolated_costs(model, drafter, context, Sampling(args.temperature), repeats, c_t=plain.c_t)
        rows.append({"method": "speculative", "drafter": name, "K": drafter.num_draft_tokens,
                     "tau": round(stats.tau, 3), "tokens_per_s": round(n / seconds, 1),
                     "speedup": round((n / seconds) / (ar_n / ar_s), 3),
                     **parts.columns(stats.tau, seconds / forwards)})
    return rows


@torch.no_grad()
def forward_costs(target, context: torch.Tensor, n: int, repeats: int) -> tuple[float, float]:
    """(bare, minispec): seconds of one forward over `n` new tokens after `context` [L] at batch 1, best of
    `repeats`, each followed by dropping those tokens again. Bare: the model's own forward into a
    `DynamicCache`, then `crop`. minispec: what its loops pay, the adapter's `forward` (a verify window: the
    attention mask, position ids, a rollback-ready cache) and its `rollback`."""
    from transformers import DynamicCache

    tokens = context[-n:][None]  # any n tokens: the cost does not depend on which
    cache = DynamicCache(config=target.config)
    target(input_ids=context[None], cache=cache, use_cache=True)

    def bare():
        target(input_ids=tokens, cache=cache, use_cache=True)
        cache.crop(-n)

    adapter = target_adapter(target, output_hidden_states=True)  # DFlash reads the hidden states
    adapter.prefill(as_prompt_batch(context[None], special_ids(target)[0]))
    none = torch.zeros(1, dtype=torch.long)

    def minispec():
        adapter.forward(tokens)
        adapter.rollback(none, n)

    return timed(bare, repeats)[0], timed(minispec, repeats)[0]


def measured_roofline(repeats: int = 3) -> costs.Accelerator:
    """This CPU at torch's current thread count, as the roofline sees it: float32 FLOP/s of a 2048^3 matmul and
    the bytes/s of copying 256 MB (read + write), each the best of `repeats`, timed apart from any model."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    matmul = timed(lambda: a @ b, repeats)[0]
    src = torch.empty(64 * 2**20)  # 256 MB of float32: far past any cache
    dst = torch.empty_like(src)
    copy = timed(lambda: dst.copy_(src), repeats)[0]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return costs.Accelerator(f"this CPU, {torch.get_num_threads()} threads", memory, 2 * src.nbytes / copy,
                             2 * 2048**3 / matmul)


def served_model(model) -> costs.ServedModel:
    """A dense Hugging Face causal LM as the roofline sees it: every weight read once per forward (a tied head
    reads the embedding table whole; an untied model's embedding is only looked up), 2 FLOPs per weight it
    multiplies, per token, and the KV cache of every layer."""
    numel = sum(p.numel() for p in model.parameters())
    lookup = 0 if model.config.tie_word_embeddings else model.get_input_embeddings().weight.numel()
    size = next(model.parameters()).element_size()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return costs.ServedModel(type(model).__name__, numel * size, (numel - lookup) * size, 2 * (numel - lookup),
                             kv_bytes_per_token=cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * size)


def bench_forward(args) -> list[dict]:
    """C(n) / C(1), a forward over n new tokens against a one-token forward, bare and as minispec's loops pay
    it, at 1 and 2 threads, after the first benchmark prompt's context: how far a verify window of n tokens
    is from the cost of one decode step on this machine, and how much of that minispec adds. Beside them the
    roofline's prediction from this CPU's separately measured FLOP/s and bandwidth (`measured_roofline`), and
    an H200's for the same model in bfloat16 (`minispec.costs.H200`)."""
    model, tokenizer = ms.load_target(args.target, dtype=getattr(torch, args.dtype))
    context = bench_prompts(tokenizer)[0]
    served, L = served_model(model), len(context)
    h200 = served_model(ms.load_target(args.target, dtype=torch.bfloat16)[0])

    def ratio(hw, m, n):
        return costs.forward_seconds(m, hw, 1, n, L) / costs.forward_seconds(m, hw, 1, 1, L)

    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        cpu = measured_roofline()
        timed_n = {n: forward_costs(model, context, n, args.repeats) for n in sorted({1, *args.tokens})}
        (bare_1, ours_1) = timed_n[1]
        rows += [{"model": str(args.target), "dtype": args.dtype, "threads": threads, "context": L, "n": n,
                  "bare_ms": round(1000 * bare, 2), "minispec_ms": round(1000 * ours, 2),
                  "bare_ratio": round(bare / bare_1, 3), "minispec_ratio": round(ours / ours_1, 3),
                  "minispec_over_bare": round(ours / bare, 3), "roofline_ms": round(
                      1000 * costs.forward_seconds(served, cpu, 1, n, L), 2),
                  "roofline_ratio": round(ratio(cpu, served, n), 3), "cpu_gflops": round(cpu.flops / 1e9, 1),
                  "cpu_gb_per_s": round(cpu.bandwidth / 1e9, 1), "h200_ratio": round(ratio(costs.H200, h200, n), 3)}
                 for n, (bare, ours) in timed_n.items()]
    return rows
