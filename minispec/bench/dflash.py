"""DFlash against plain decoding and the other drafters, in one process (`python -m minispec.bench dflash`).

    python -m minispec.bench dflash                                    bolt-mini on its stdlib eval set
    python -m minispec.bench dflash --target smollm2-135m --prompts 4  SmolLM2-135M-Instruct on MT-Bench
    ... --draft-tokens auto 7                                          at the K the cost model picks, and at 7

1. Acceptance: tau and the per-position acceptance, per temperature and drafting policy ("argmax" and
   "sample", `minispec.dflash.drafter`; at T = 0 both draft the argmax, so one row), in batches, on the
   target's benchmark prompts (`decoding.bench_prompts`: MT-Bench's 80 first turns for a chat model, the
   frozen stdlib eval set for bolt-mini); beside them the argmax ceiling, the best tau any ARGMAX drafter
   could reach there. Sampled drafts are not bound by it.
2. Wall clock at batch 1 on the first `--prompts` of those prompts, one after the other, every method in
   the same process on the same prompts with the same max_new_tokens, the methods taking turns pass by pass
   (`timed_sets`): plain decoding, minispec's n-gram drafter and DFlash, and Hugging Face's own `generate`:
   greedy, prompt-lookup decoding (`prompt_lookup_num_tokens=K`) and assisted decoding with the target's
   draft LM where it has one (bolt-mini: bolt-nano; smollm2-135m has none). Every drafter drafts the DFlash
   drafter's K tokens; `--draft-tokens` adds DFlash rows at other K (a verify window of K + 1 tokens is not
   free on a CPU).
   At T = 0 every output is compared with minispec's plain decoding: identical when its first n tokens are
   the n tokens plain decoding emitted (an EOS included); Hugging Face's `generate` may stop or pad
   differently after them. Hugging Face's rows are run at T = 0 only.
3. `--draft-tokens auto`: the cost model picks K before the wall-clock runs, from held-out prompts the
   benchmark never sees (`pick_draft_tokens`), and DFlash is timed at that K too.
4. The cost model checked: speedup = tau * C_t / (C_d + C_v) with C_t, C_d and C_v timed in isolation
   (`decoding.isolated_costs`), never derived from the run it predicts: predicted and measured speedup side
   by side, with the measured wall time per target forward and what the isolated parts leave of it (the
   loop's overhead, prefills included).

Speedups are against the same library's plain decoding: minispec's methods against
`ms.autoregressive_generate`, Hugging Face's against its greedy `generate`. tau is tokens per target forward:
for minispec accepted drafts + 1 per verification (`SpecStats.tau`), for Hugging Face new tokens per target
forward (its first forward prefills and verifies at once).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import minispec as ms
from minispec import costs
from minispec.bench.decoding import (
    GREEDY,
    CycleCosts,
    bench_prompts,
    decode_step_cost,
    isolated_costs,
    plain_decoding_costs,
    representative_context,
    tuning_prompts,
)
from minispec.bench.timing import timed
from minispec.speculative import sampling as smp
from minispec.speculative.autoregressive import special_ids
from minispec.speculative.batch import as_prompt_batch
from minispec.speculative.drafter import Sampling
from minispec.speculative.stats import SpecStats
from minispec.speculative.target import target_adapter
from minispec.training import weights_digest

DFLASH_DRAFTERS = {"bolt-mini": "bolt-mini-dflash", "smollm2-135m": "smollm2-135m-dflash"}
DRAFT_LMS = {"bolt-mini": "bolt-nano"}  # the draft model of Hugging Face's assisted decoding, per target
COST_COLUMNS = ("C_t_ms", "C_d_ms", "C_v_ms", "predicted_speedup", "cycle_ms", "overhead_ms")


# --- acceptance ----------------------------------------------------------------------------------------------

def acceptance(target, drafter, prompts, max_new_tokens: int, temperature: float, batch_size: int = 16,
               seed: int = 0, progress=None) -> tuple[SpecStats, list[torch.Tensor]]:
    """Speculative decoding over `prompts` in batches: the merged statistics of every cycle, and each
    prompt's new tokens [n_i] (distributed as the target's own generation at `temperature`)."""
    stats, continuations = SpecStats(), []
    generator = torch.Generator().manual_seed(seed)
    for i in range(0, len(prompts), batch_size):
        out = ms.speculative_generate(target, drafter, prompts[i: i + batch_size], max_new_tokens,
                                      temperature=temperature, generator=generator)
        stats.cycles.extend(out.stats.cycles)
        continuations += [row[:n] for row, n in zip(out.tokens, out.lengths.tolist())]
        if progress is not None:
            progress(f"{len(continuations)}/{len(prompts)} prompts, tau so far {stats.tau:.2f}")
    return stats, continuations


@torch.no_grad()
def argmax_ceiling(target, prompts, continuations, temperature: float, K: int = 7, starts: int = 4,
                   batch_size: int = 16) -> float:
    """The best tau any argmax drafter can reach here: it drafts the target's own greedy continuation.

    Along the target's own generations at `temperature` (`continuations` of `prompts`), from `starts`
    positions per prompt: the perfect argmax drafter proposes d_1 .. d_K = the target's greedy
    continuation, and one-hot rejection accepts d_k with probability p_T(d_k | context, d_<k), so
    E[tau] = 1 + sum_k prod_{j<=k} p_T(d_j). At T = 0 this is K + 1; at T > 0 it is bounded by how peaked
    the target's distribution is, whatever the argmax drafter. It bounds argmax drafts only: a sampled
    draft is accepted with 1 - TV(p_T, q), which a drafter whose q is close to p_T can bring near 1.
    """
    if temperature == 0:
        return K + 1.0  # p_0 is one-hot at the greedy token, which is exactly what is drafted
    contexts = []
    for prompt, continuation in zip(prompts, continuations):
        text = torch.cat([torch.as_tensor(prompt), continuation])
        contexts += [text[:start] for start in torch.linspace(len(prompt), len(text) - 1, starts).long().tolist()]
    taus = []
    for i in range(0, len(contexts), batch_size):
        tgt = target_adapter(target)
        logits = tgt.prefill(as_prompt_batch(contexts[i: i + batch_size], special_ids(target)[0])).logits[:, -1]
        accept = []
        for k in range(K):
            d = smp.greedy(logits)
            accept.append(smp.sampling_probs(logits.float(), temperature).gather(-1, d[:, None])[:, 0])
            if k < K - 1:
                logits = tgt.extend(d[:, None]).logits[:, -1]
        taus += (1 + torch.stack(accept, dim=1).cumprod(dim=1).sum(dim=1)).tolist()
    return sum(taus) / len(taus)


def draft_vocab_coverage(drafter, continuations) -> float:
    """The share of the target's own tokens that the drafter can draft at all: 1 unless it drafts over a
    reduced vocabulary, whose missing tokens are never accepted as drafts."""
    vocab = getattr(getattr(drafter, "model", None), "draft_vocab", lambda: None)()
    tokens = torch.cat(continuations)
    return 1.0 if vocab is None or len(tokens) == 0 else float(torch.isin(tokens, vocab).float().mean())


def acceptance_rows(target, drafter_name: str, drafters: dict, prompts, max_new_tokens: int, temperatures,
                    batch_size: int, progress) -> list[dict]:
    """Per temperature and policy, tau and per-position acceptance over `prompts`, and the argmax ceiling on
    up to 32 of them."""
    rows = []
    every = -(-len(prompts) // 32)
    for temperature in temperatures:
        # At T = 0 every policy drafts the argmax: one run stands for both.
        runs = {"both": next(iter(drafters.values()))} if temperature == 0 else drafters
        ceiling = None
        for policy, drafter in runs.items():
            stats, continuations = acceptance(target, drafter, prompts, max_new_tokens, temperature, batch_size,
                                              progress=lambda m, label=f"acceptance T = {temperature}, {policy}: ":
                                              progress(label + m))
            if ceiling is None:
                progress(f"argmax ceiling T = {temperature}")
                ceiling = argmax_ceiling(target, prompts[::every], continuations[::every], temperature,
                                         K=drafter.num_draft_tokens)
            row = {"drafter": drafter_name, "drafter_weights": weights_digest(drafter.model), "policy": policy,
                   "T": temperature, "prompts": len(prompts),
                   "max_new_tokens": max_new_tokens, "tau": round(stats.tau, 3),
                   "argmax_ceiling_tau": round(ceiling, 3),
                   "draft_vocab_coverage": round(draft_vocab_coverage(drafter, continuations), 4)}
            row.update({f"acc_{k + 1}": round(float(a), 3) for k, a in enumerate(stats.per_position)})
            rows.append(row)
    return rows


# --- the cost model picks K -----------------------------------------------------------------------------------

def pick_draft_tokens(target, drafter_name: str, prompts, max_new_tokens: int, batch_size: int, repeats: int,
                      progress) -> list[dict]:
    """One row per K = 1 .. block - 1: the tau the cost model expects there and its predicted speedup, the
    largest marked `picked`. Everything comes from `prompts` (held out from the benchmark, `tuning_prompts`):

        a_1 .. a_7   per-position acceptance at T = 0 with the full window (`SpecStats.per_position`)
        tau(K)       1 + sum_{j<=K} prod_{i<=j} a_i (`costs.expected_tau`)
        C_d, C_v     timed alone at each K after the first prompt's context (`isolated_costs`), the best of
                     `repeats` rounds over every K

    A verify over K + 1 tokens costs more than a decode step on a CPU, and a drafter's late positions are
    rarely accepted, so the full window need not be the best there; on an H200 at batch 1 it is (C_v barely
    grows with K).
    """
    drafter = ms.load_drafter(drafter_name, target)
    stats, continuations = acceptance(target, drafter, prompts, max_new_tokens, 0.0, batch_size,
                                      progress=lambda m: progress(f"picking K, held-out acceptance: {m}"))
    rates = stats.per_position.tolist()
    context = representative_context(prompts[0], continuations[0])
    progress("picking K: timing C_t, C_d and C_v at every K")
    c_t = decode_step_cost(target, context, repeats)
    windows = {**{k: ms.load_drafter(drafter_name, target, num_draft_tokens=k)
                  for k in range(1, drafter.num_draft_tokens)}, drafter.num_draft_tokens: drafter}
    # Every K once per round, the best of the rounds: a shared machine's clock drifts by 10 % and more within a
    # minute, and timing the K one after the other would hand that drift to the pick.
    rounds = [{k: isolated_costs(target, w, context, GREEDY, 2, c_t=c_t) for k, w in windows.items()}
              for _ in range(repeats)]
    parts = {k: CycleCosts(c_t, min(r[k].c_d for r in rounds), min(r[k].c_v for r in rounds)) for k in windows}
    best = costs.best_window(rates, c_t, {k: p.c_d for k, p in parts.items()}, {k: p.c_v for k, p in parts.items()})
    rows = []
    for k, p in parts.items():
        tau = costs.expected_tau(rates[:k])
        rows.append({"drafter": drafter_name, "K": k, "tuning_prompts": len(prompts),
                     "acc_k": round(rates[k - 1], 3), "expected_tau": round(tau, 3), "C_t_ms": round(1000 * c_t, 2),
                     "C_d_ms": round(1000 * p.c_d, 3), "C_v_ms": round(1000 * p.c_v, 2),
                     "predicted_speedup": round(costs.speedup(tau, c_t, p.c_d, p.c_v), 3), "picked": k == best})
    return rows


# --- wall clock and the cost model --------------------------------------------------------------------------

@dataclass
class Decoded:
    """One prompt decoded at batch 1."""
    tokens: torch.Tensor  # the new tokens [n]
    forwards: int  # target forwards, the prefill included
    cycles: list  # minispec's speculative cycle records (`SpecStats`); empty for every other method


@dataclass
class Run:
    """One method over the timing prompts at batch 1."""
    seconds: float  # wall time of the whole set, once (the faster of `timed_sets`' passes)
    outputs: list[torch.Tensor]  # per prompt, the new tokens [n_i]
    forwards: int  # target forwards, prefills included
    tau: float

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds

    @classmethod
    def of(cls, seconds: float, decoded: list[Decoded]) -> Run:
        """minispec's tau is `SpecStats.tau` over every verification; any other method's is new tokens per
        target forward (1 for plain decoding)."""
        outputs, forwards = [d.tokens for d in decoded], sum(d.forwards for d in decoded)
        cycles = [c for d in decoded for c in d.cycles]
        tau = SpecStats(cycles).tau if cycles else sum(len(o) for o in outputs) / forwards
        return cls(seconds, outputs, forwards, tau)


def timed_sets(methods: dict, prompts, passes: int = 2) -> dict[str, Run]:
    """Every method of `methods` ({name: decode(prompt) -> Decoded}) over every prompt, as a `Run` per name.

    Each method is warmed up on the first prompt, then the methods take turns: in each of `passes` rounds every
    method decodes the whole set once, and its faster pass is kept. Taking turns matters on a shared machine,
    whose clock can drift by 15 % within minutes: timed one after the other, the method that ran first
    would carry the slow minutes alone; interleaved, every method meets the same ones.
    """
    for decode in methods.values():
        decode(prompts[0])
    best = {name: (float("inf"), None) for name in methods}
    for _ in range(passes):
        for name, decode in methods.items():
            seconds, decoded = timed(lambda decode=decode: [decode(p) for p in prompts], 1, warmup=0)
            if seconds < best[name][0]:
                best[name] = (seconds, decoded)
    return {name: Run.of(seconds, decoded) for name, (seconds, decoded) in best.items()}


def minispec_decoder(target, drafter, max_new_tokens: int, temperature: float, seed: int = 0):
    """decode(prompt) -> Decoded: minispec's speculative decoding with `drafter`, or plain decoding when
    `drafter` is None."""
    def decode(prompt):
        generator = torch.Generator().manual_seed(seed)
        if drafter is None:
            out = ms.autoregressive_generate(target, prompt, max_new_tokens, temperature=temperature,
                                             generator=generator)
            tokens = out.tokens[0, : int(out.lengths[0])]
            return Decoded(tokens, len(tokens), [])  # one forward per token, the prefill's included
        out = ms.speculative_generate(target, drafter, prompt, max_new_tokens, temperature=temperature,
                                      generator=generator)
        cycles = out.stats.cycles
        return Decoded(out.tokens[0, : int(out.lengths[0])], len(SpecStats(cycles).verifications) + 1, cycles)

    return decode


def hf_decoder(target, max_new_tokens: int, **generate_kwargs):
    """decode(prompt) -> Decoded: Hugging Face's greedy `model.generate`, its target forwards counted by a
    forward hook held for that call only."""
    def decode(prompt):
        forwards, ids = [], prompt[None]
        hook = target.register_forward_hook(lambda *_: forwards.append(1))
        try:
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, **generate_kwargs)
        finally:
            hook.remove()
        return Decoded(out[0, len(prompt):], len(forwards), [])

    return decode


def hf_prompt_lookup_cost(target, context: torch.Tensor, K: int, max_new_tokens: int, repeats: int) -> float:
    """C_d of Hugging Face's prompt lookup: one `PromptLookupCandidateGenerator.get_candidates` call on
    `context` [L], built as greedy `generate` builds it, best of `repeats`."""
    from transformers import LogitsProcessorList
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    eos = special_ids(target)[1]
    lookup = PromptLookupCandidateGenerator(eos_token_id=None if eos is None else torch.tensor([eos]),
                                            num_output_tokens=K, max_length=len(context) + max_new_tokens,
                                            logits_processor=LogitsProcessorList(),
                                            vocab_size=target.config.vocab_size)
    return timed(lambda: lookup.get_candidates(context[None]), repeats)[0]


def identical(outputs, reference) -> bool:
    """Each output's first n tokens are the reference's n tokens (n = the reference's length, EOS included)."""
    return all(len(o) >= len(r) and torch.equal(o[: len(r)], r) for o, r in zip(outputs, reference))


def timing_row(method: str, run: Run, baseline: Run, baseline_name: str, parts: CycleCosts | None,
               temperature: float, K: int, ar: Run) -> dict:
    """The method's tau and tokens/s, its speedup over `baseline`, the cost columns (`parts`; "-" for a method
    whose drafting is not timed alone) and, at T = 0, whether it reproduced plain decoding's outputs `ar`."""
    row = {"method": method, "T": temperature, "K": K, "prompts": len(run.outputs), "tau": round(run.tau, 3),
           "tokens_per_s": round(run.tokens_per_s, 1), "speedup": round(run.tokens_per_s / baseline.tokens_per_s, 3),
           "speedup_vs": baseline_name}
    row.update(parts.columns(run.tau, run.seconds / run.forwards) if parts is not None
               else dict.fromkeys(COST_COLUMNS, "-"))
    # At T = 0 the outputs must be the same tokens; at T > 0 they are equal in distribution only.
    row["identical_to_ar"] = identical(run.outputs, ar.outputs) if temperature == 0 else "-"
    return row


def side_by_side(target, drafter, prompts, max_new_tokens: int, temperature: float, seed: int = 0,
                 repeats: int = 5) -> dict:
    """Batch 1, prompt after prompt: plain decoding and speculative decoding with `drafter`, taking turns
    (`timed_sets`); one row: tau, both tokens/s, the measured speedup beside the prediction from isolated C_t,
    C_d and C_v, and the loop's overhead."""
    runs = timed_sets({"ar": minispec_decoder(target, None, max_new_tokens, temperature, seed),
                       "spec": minispec_decoder(target, drafter, max_new_tokens, temperature, seed)}, prompts)
    ar, spec = runs["ar"], runs["spec"]
    parts = isolated_costs(target, drafter, representative_context(prompts[0], ar.outputs[0]),
                           Sampling(temperature), repeats, seed)
    return {"ar_tokens_per_s": round(ar.tokens_per_s, 1),
            **timing_row("speculative", spec, ar, "autoregressive", parts, temperature, drafter.num_draft_tokens,
                         ar)}


def timing_rows(target, drafters: dict, prompts, max_new_tokens: int, temperature: float, draft_lm=None,
                repeats: int = 5, progress=print) -> list[dict]:
    """Every method at batch 1 on the same prompts, taking turns (`timed_sets`; see the module docstring).
    `drafters`: minispec drafters by method name, "ngram" among them; `draft_lm`: the causal LM for Hugging
    Face's assisted decoding, or None."""
    K = drafters["ngram"].num_draft_tokens  # what Hugging Face's prompt lookup drafts
    decoders = {"autoregressive": minispec_decoder(target, None, max_new_tokens, temperature)}
    decoders.update({method: minispec_decoder(target, drafter, max_new_tokens, temperature)
                     for method, drafter in drafters.items()})
    if temperature == 0:
        decoders["HF generate greedy"] = hf_decoder(target, max_new_tokens)
        decoders["HF prompt lookup"] = hf_decoder(target, max_new_tokens, prompt_lookup_num_tokens=K)
        if draft_lm is not None:
            draft_lm.generation_config.num_assistant_tokens = K
            draft_lm.generation_config.num_assistant_tokens_schedule = "constant"
            decoders["HF assisted decoding"] = hf_decoder(target, max_new_tokens, assistant_model=draft_lm)
    progress(f"timing T = {temperature}: {', '.join(decoders)}, taking turns")
    runs = timed_sets(decoders, prompts)
    ar = runs["autoregressive"]
    context = representative_context(prompts[0], ar.outputs[0])
    progress(f"timing T = {temperature}: the cost model's parts, each alone")
    plain = plain_decoding_costs(target, context, repeats)
    rows = [timing_row("autoregressive", ar, ar, "autoregressive", plain, temperature, 0, ar)]
    parts = {}
    for method, drafter in drafters.items():
        parts[method] = isolated_costs(target, drafter, context, Sampling(temperature), repeats, c_t=plain.c_t)
        rows.append(timing_row(method, runs[method], ar, "autoregressive", parts[method], temperature,
                               drafter.num_draft_tokens, ar))
    if temperature != 0:
        return rows
    greedy = runs["HF generate greedy"]
    rows.append(timing_row("HF generate greedy", greedy, greedy, "HF greedy", plain, 0.0, 0, ar))
    # The verify forward is the target's over K + 1 tokens, as timed for minispec's n-gram drafter: an upper
    # bound, since Hugging Face verifies only the candidates it found (none when nothing matches).
    lookup_parts = CycleCosts(plain.c_t, hf_prompt_lookup_cost(target, context, K, max_new_tokens, repeats),
                              parts["ngram"].c_v)
    rows.append(timing_row("HF prompt lookup", runs["HF prompt lookup"], greedy, "HF greedy", lookup_parts, 0.0,
                           K, ar))
    if draft_lm is not None:
        # Its drafting runs inside `generate`; it is not timed alone, so there is no prediction for it.
        rows.append(timing_row("HF assisted decoding", runs["HF assisted decoding"], greedy, "HF greedy", None,
                               0.0, K, ar))
    return rows


def default_drafter(target_name) -> str:
    if str(target_name) not in DFLASH_DRAFTERS:
        raise ValueError(f"no shipped DFlash drafter for target {str(target_name)!r} (known: "
                         f"{sorted(DFLASH_DRAFTERS)}): pass --drafter with a DFlash drafter folder")
    return DFLASH_DRAFTERS[str(target_name)]


def bench_dflash(args) -> list[dict]:
    """Acceptance rows per temperature and policy, then timing rows per method (see the module docstring)."""
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {message}", flush=True)

    model, tokenizer = ms.load_target(args.target, dtype=getattr(torch, args.dtype))
    drafter_name = args.drafter or default_drafter(args.target)
    drafters = {policy: ms.load_drafter(drafter_name, model, policy=policy) for policy in args.policies}
    prompts = bench_prompts(tokenizer)
    chosen = prompts if args.eval_prompts is None else prompts[: args.eval_prompts]
    rows = [{"target": str(args.target), **row}
            for row in acceptance_rows(model, str(drafter_name), drafters, chosen, args.max_new_tokens,
                                       args.temperatures, args.eval_batch, progress)]

    K = next(iter(drafters.values())).num_draft_tokens
    draft_lm = (ms.load_target(DRAFT_LMS[str(args.target)], dtype=model.dtype)[0] if str(args.target) in DRAFT_LMS
                else None)
    if draft_lm is None:
        progress(f"{args.target} has no draft LM that shares its tokenizer: Hugging Face's assisted decoding is "
                 "not measured")
    draft_tokens = args.draft_tokens or [K]
    if len(set(draft_tokens)) != len(draft_tokens):
        raise ValueError(f"--draft-tokens names a K twice: {draft_tokens}")
    picked = None
    if "auto" in draft_tokens:
        picks = pick_draft_tokens(model, drafter_name, tuning_prompts(str(args.target), tokenizer, args.tuning_prompts),
                                  args.max_new_tokens, args.eval_batch, max(args.repeats, 3), progress)
        rows += [{"target": str(args.target), **row} for row in picks]
        picked = next(row["K"] for row in picks if row["picked"])
        # The pick's row stands for an explicit request of the same K.
        draft_tokens = [picked if k == "auto" else k for k in draft_tokens if k != picked]
    for temperature in args.timing_temperatures:
        methods = {"ngram": ms.load_drafter("ngram", model, num_draft_tokens=K)}
        policies = list(drafters)[:1] if temperature == 0 else list(drafters)  # at T = 0 every policy drafts the argmax
        for policy in policies:
            for k in draft_tokens:
                name = (("DFlash" if temperature == 0 else f"DFlash {policy}") + ("" if k == K else f" K={k}")
                        + (" (cost model's K)" if k == picked else ""))
                methods[name] = (drafters[policy] if k == K
                                 else ms.load_drafter(drafter_name, model, policy=policy, num_draft_tokens=k))
        rows += [{"target": str(args.target), **row}
                 for row in timing_rows(model, methods, prompts[: args.prompts], args.max_new_tokens, temperature,
                                        draft_lm, max(args.repeats, 3), progress)]
    return rows
