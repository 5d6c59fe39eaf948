"""Does the quantized model still behave like the BF16 one? Scored as "NVFP4 quantization and QAD of
Nemotron 3.5 Lightning" scores it: a suite of metrics, each as quantized / BF16, summarized by the median
score recovery, plus the reply-length drift.

Metrics on the frozen eval set (held-out code, teacher-forced), all "higher is better":

    accuracy            next-token argmax accuracy on the 128-token continuations
    accuracy/<cat>      the same on tokens of one category: name, keyword, whitespace, punctuation, literal
    likelihood          exp(−loss): the geometric-mean probability of the true next token
    likelihood/<cat>    the same per category (so a loss is compared as a ratio of probabilities)
    agreement           fraction of positions where the model's argmax equals the BF16 model's (BF16: 1)
    tau                 mean tokens per speculative cycle (accepted + 1) with a drafter, if one is given

    recovery_k = metric_k(quantized) / metric_k(BF16);   median score recovery = median_k recovery_k

Reply-length drift = mean greedy reply length (capped) of the quantized model / BF16's − 1; "Nemotron 3.5
Super and Lightning: Open, Efficient Mixture-of-Experts Hybrid Mamba-Transformer Models for Agentic AI"
caps it at +5 % (longer replies cost tokens); `length_drift_ok` asks for ±5 %, since a reply that stops early
changed too. The paper's replies end at EOS; bolt-mini's greedy continuations of held-out files rarely reach
EOS within the cap, so a reply here ends at EOS or at the first blank line (`reply_stop_ids`), the end of
a block of code. Replies start near the end of held-out files.

A chat target (SmolLM2-135M-Instruct) is scored by `chat_suite` on what it is for, answering, with the
frozen BF16 model's greedy replies to MT-Bench's first turns as the reference, and on the eval set:

    mtbench/agreement   fraction of the BF16 reply's tokens that are the model's own argmax, given the
                        reply so far (teacher-forced greedy agreement; BF16: 1)
    mtbench/exp_neg_kl  exp(−KL(BF16 ‖ model)), the KL per token on the BF16 replies (BF16: 1)
    mtbench/prefix      the share of the BF16 reply that the model's own free-running greedy reply repeats
                        before it first differs (BF16: 1)
    eval/accuracy, eval/likelihood, eval/agreement   as above, on the eval set's continuations

plus the reply-length drift of its free-running greedy replies to the same prompts, which end at EOS.

Five of these six compare the model with its teacher token by token, so they are much stricter than the
papers' recoveries, which are ratios of benchmark scores (eval/accuracy is the one of that kind here). Their
resolution is measured, not assumed: `python -m minispec.quant.report --scorecard` also scores the BF16
checkpoint run in BF16 arithmetic instead of the teacher's FP32 ("bf16-arith"), a model that changed nothing
but rounding. On SmolLM2-135M-Instruct it reads 99.07 % median recovery (a near-tie flips in 2 % of greedy
tokens): a median above it would mean a 4-bit model stays closer to the teacher than the teacher's own
weights do in BF16 arithmetic.
"""
from __future__ import annotations

import keyword
import math
import statistics
from dataclasses import dataclass

import torch
from torch.nn import functional as F

CATEGORIES = ("name", "keyword", "whitespace", "punctuation", "literal")
LENGTH_DRIFT_CAP = 0.05


def token_category(text: str) -> str:
    """The category of a token's text: whitespace, keyword, name, literal (digits, quotes) or punctuation."""
    core = text.strip()
    if not core:
        return "whitespace"
    if keyword.iskeyword(core) or core in ("self", "None", "True", "False"):
        return "keyword"
    if core.replace("_", "a").isalnum() and not core[0].isdigit():
        return "name"
    if any(c.isdigit() or c in "'\"" for c in core) or core.isalnum():
        return "literal"
    return "punctuation"


def token_categories(tokenizer, vocab_size: int) -> torch.Tensor:
    """[V] index into CATEGORIES of every token id."""
    return torch.tensor([CATEGORIES.index(token_category(tokenizer.decode([i]))) for i in range(vocab_size)])


@dataclass
class Predictions:
    argmax: torch.Tensor  # [N] the model's most likely next token at each scored position
    logprob: torch.Tensor  # [N] log-probability it gave the true next token
    targets: torch.Tensor  # [N] the true next tokens


@torch.no_grad()
def predictions(model, evalset, n_prompts: int | None = None) -> Predictions:
    """Teacher-forced predictions on the continuations of the first `n_prompts` eval prompts."""
    model.eval()
    argmax, logprob, targets = [], [], []
    for prompt, cont in list(zip(evalset.prompts, evalset.continuations))[:n_prompts]:
        ids = torch.cat([prompt, cont])[None].to(model.device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
        argmax.append(logits.argmax(-1).cpu())
        logprob.append(-F.cross_entropy(logits, cont.to(logits.device), reduction="none").cpu())
        targets.append(cont)
    return Predictions(torch.cat(argmax), torch.cat(logprob), torch.cat(targets))


def metric_suite(pred: Predictions, reference: Predictions, categories: torch.Tensor) -> dict[str, float]:
    """The metrics of the module doc for `pred`, with `reference` (the BF16 model's) for agreement."""
    if not torch.equal(pred.targets, reference.targets):
        raise ValueError("predictions and reference were made on different tokens")
    correct = (pred.argmax == pred.targets).float()
    cat = categories[pred.targets]
    out = {"accuracy": correct.mean().item(), "likelihood": pred.logprob.mean().exp().item()}
    for i, name in enumerate(CATEGORIES):
        mask = cat == i
        if mask.any():
            out[f"accuracy/{name}"] = correct[mask].mean().item()
            out[f"likelihood/{name}"] = pred.logprob[mask].mean().exp().item()
    out["agreement"] = (pred.argmax == reference.argmax).float().mean().item()
    return out


def recovery(quantized: dict[str, float], bf16: dict[str, float]) -> dict[str, float]:
    """metric -> quantized / BF16, over the metrics both have."""
    return {k: quantized[k] / bf16[k] for k in bf16 if k in quantized and bf16[k] > 0}


def median_recovery(quantized: dict[str, float], bf16: dict[str, float]) -> float:
    return statistics.median(recovery(quantized, bf16).values())


# --- replies to EOS -------------------------------------------------------------------------------

def length_prompts(stream: torch.Tensor, eos_id: int, bos_id: int, n: int = 16, prompt_len: int = 96,
                   seed: int = 0) -> list[torch.Tensor]:
    """`n` prompts that end 16..64 tokens before the end (EOS) of a file in `stream` (a corpus split as
    `<bos> file <eos> ...`), so a model that has learned where files end replies with an EOS."""
    g = torch.Generator().manual_seed(seed)
    ends = (stream == eos_id).nonzero().flatten().tolist()
    prompts = []
    for end in torch.randperm(len(ends), generator=g).tolist():
        lead = int(torch.randint(16, 65, (1,), generator=g))
        start = ends[end] - lead - prompt_len
        window = stream[max(start, 0): ends[end] - lead]
        if start >= 0 and not (window == bos_id).any() and not (window == eos_id).any():
            prompts.append(window)
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} files in the stream are long enough for {n} length prompts")
    return prompts


def reply_stop_ids(tokenizer) -> list[int]:
    """EOS and every token that contains a blank line ("\n\n"): where a code reply naturally ends."""
    return [tokenizer.eos_token_id] + [i for i in range(len(tokenizer)) if "\n\n" in tokenizer.decode([i])]


def reply_lengths(model, prompts, max_new_tokens: int = 160, stop_ids=None) -> torch.Tensor:
    """[n] greedy reply lengths (the stop token included; `max_new_tokens` where none came).

    stop_ids: the tokens that end a reply; by default only the model's EOS."""
    from minispec.speculative.autoregressive import autoregressive_generate

    out = autoregressive_generate(model, prompts, max_new_tokens)
    if stop_ids is None:
        return out.lengths
    live = torch.arange(out.tokens.shape[1])[None, :] < out.lengths[:, None]
    stop = torch.isin(out.tokens, torch.tensor(stop_ids, device=out.tokens.device)) & live
    return torch.where(stop.any(1), stop.float().argmax(1) + 1, out.lengths)


def length_drift(quant_lengths: torch.Tensor, bf16_lengths: torch.Tensor) -> float:
    """Mean reply length of the quantized model relative to BF16's, minus 1 (+0.05 = 5 % longer)."""
    return quant_lengths.float().mean().item() / bf16_lengths.float().mean().item() - 1


# --- speculative decoding -------------------------------------------------------------------------

def speculative_tau(target, drafter, prompts, max_new_tokens: int = 48) -> float:
    """Mean tokens per verification (accepted drafts + 1) of greedy speculative decoding, batch 1 per prompt.

    drafter: a Drafter for `target`, or a callable target -> Drafter (a DFlash drafter must be attached to
    the model whose hidden states it reads, so it is built per target)."""
    from minispec.speculative.speculative import speculative_generate

    d = drafter(target) if callable(drafter) else drafter
    accepted = cycles = 0
    for p in prompts:
        stats = speculative_generate(target, d, p, max_new_tokens).stats
        accepted += sum(c.accepted + 1 for c in stats.verifications)
        cycles += len(stats.verifications)
    return accepted / cycles


def dflash_drafter_for(drafter_model):
    """target -> DFlashDrafter(drafter_model, target): attaches the drafter to whichever target it serves."""
    from minispec.dflash.drafter import DFlashDrafter

    return lambda target: DFlashDrafter(drafter_model, target)


def quantize_drafter(drafter_model, recipe: dict | None = None):
    """A quantized copy of a DFlash drafter's own layers (default: every linear W4A16 NVFP4, four-over-six).

    The drafter borrows the target's embedding and head; those are not copied and not touched here."""
    import copy

    from minispec.quant.api import quantize

    recipe = recipe or {"name": "drafter-w4a16", "algorithm": "four_over_six", "rules": [["*", "w4a16"]]}
    borrowed = drafter_model._target
    drafter_model._target = None
    try:
        q = copy.deepcopy(drafter_model)
    finally:
        drafter_model._target = borrowed
    q._target = borrowed
    return quantize(q, recipe)


def tau_with_quantized_target(target, quant_target, drafter_model, prompts, max_new_tokens: int = 48) -> dict:
    """DFlash τ with the BF16 target and with the quantized one (same drafter, same prompts)."""
    make = dflash_drafter_for(drafter_model)
    bf16 = speculative_tau(target, make, prompts, max_new_tokens)
    quant = speculative_tau(quant_target, make, prompts, max_new_tokens)
    make(target)  # leave the drafter attached to the BF16 target
    return {"tau_bf16_target": bf16, "tau_quantized_target": quant, "ratio": quant / bf16}


def tau_of_quantized_drafter(target, drafter_model, prompts, recipe: dict | None = None,
                             max_new_tokens: int = 48) -> dict:
    """τ of the DFlash drafter in W4A16 NVFP4 against the BF16 drafter, both with the BF16 target."""
    bf16 = speculative_tau(target, dflash_drafter_for(drafter_model), prompts, max_new_tokens)
    quant = speculative_tau(target, dflash_drafter_for(quantize_drafter(drafter_model, recipe)), prompts,
                            max_new_tokens)
    return {"tau_bf16_drafter": bf16, "tau_w4a16_drafter": quant, "ratio": quant / bf16}


# --- the whole report -----------------------------------------------------------------------------

def score_row(metrics: dict[str, float], bf16: dict[str, float], lengths: torch.Tensor | None = None,
              bf16_lengths: torch.Tensor | None = None) -> dict:
    """One quantized model's report row: its metrics, their recoveries and median recovery, and with reply
    lengths [n] (its own and the BF16 teacher's on the same prompts) their mean and drift, within
    ±LENGTH_DRIFT_CAP or not."""
    row = {"metrics": metrics, "recovery": recovery(metrics, bf16), "median_recovery": median_recovery(metrics, bf16)}
    if lengths is not None:
        drift = length_drift(lengths, bf16_lengths)
        row.update(mean_reply_length=lengths.float().mean().item(), reply_lengths=lengths.tolist(),
                   length_drift=drift, length_drift_ok=abs(drift) <= LENGTH_DRIFT_CAP)
    return row


def evaluate_models(teacher, models: dict, evalset, tokenizer, n_prompts: int = 48, length_prompts_=None,
                    max_new_tokens: int = 160, drafter=None, spec_prompts=None, stop_ids=None) -> dict:
    """Metrics of the BF16 teacher and of each quantized model in `models` (name -> model), their
    recoveries and median recovery, and (if length prompts are given) the reply-length drift; with a
    drafter (callable target -> Drafter), τ as one more metric of the suite."""
    cats = token_categories(tokenizer, teacher.config.vocab_size)
    ref = predictions(teacher, evalset, n_prompts)
    bf16 = metric_suite(ref, ref, cats)
    spec_prompts = spec_prompts if spec_prompts is not None else [p[-64:] for p in evalset.prompts[:4]]
    if drafter is not None:
        bf16["tau"] = speculative_tau(teacher, drafter, spec_prompts)
    bf16_lengths = reply_lengths(teacher, length_prompts_, max_new_tokens, stop_ids) if length_prompts_ else None
    report = {"bf16": {"metrics": bf16}}
    if bf16_lengths is not None:
        report["bf16"]["mean_reply_length"] = bf16_lengths.float().mean().item()
    for name, model in models.items():
        metrics = metric_suite(predictions(model, evalset, n_prompts), ref, cats)
        if drafter is not None:
            metrics["tau"] = speculative_tau(model, drafter, spec_prompts)
        lengths = reply_lengths(model, length_prompts_, max_new_tokens, stop_ids) if bf16_lengths is not None else None
        report[name] = score_row(metrics, bf16, lengths, bf16_lengths)
    if callable(drafter):
        drafter(teacher)  # leave a DFlash drafter attached to the BF16 target again
    return report


def recovery_table(report: dict) -> list[dict]:
    """Rows metric | BF16 | <model> (recovery %) ... for printing or a Markdown table."""
    names = [k for k in report if k != "bf16"]
    rows = []
    for metric, value in report["bf16"]["metrics"].items():
        row = {"metric": metric, "bf16": round(value, 4)}
        for n in names:
            r = report[n]["recovery"].get(metric)  # absent where BF16 scores 0
            row[n] = f"{report[n]['metrics'][metric]:.4f} ({'n/a' if r is None else f'{100 * r:.2f}%'})"
        rows.append(row)
    rows.append({"metric": "MEDIAN RECOVERY", "bf16": "100%",
                 **{n: f"{100 * report[n]['median_recovery']:.2f}%" for n in names}})
    if "mean_reply_length" in report["bf16"]:
        rows.append({"metric": "reply length", "bf16": round(report["bf16"]["mean_reply_length"], 1),
                     **{n: f"{report[n]['mean_reply_length']:.1f} ({100 * report[n]['length_drift']:+.1f}%)"
                        for n in names}})
    return rows


# --- a chat target: MT-Bench first turns ------------------------------------------------------------

def greedy_replies(model, prompts: list[torch.Tensor], max_new_tokens: int, batch: int = 16) -> list[torch.Tensor]:
    """Each prompt's greedy reply [n_i], EOS included where it came within `max_new_tokens`."""
    from minispec.speculative.autoregressive import autoregressive_generate

    model.eval()
    out = []
    for i in range(0, len(prompts), batch):
        gen = autoregressive_generate(model, prompts[i: i + batch], max_new_tokens)
        out += [row[:n].clone() for row, n in zip(gen.tokens, gen.lengths.tolist())]
    return out


@torch.no_grad()
def reply_scores(teacher, model, prompts: list[torch.Tensor], replies: list[torch.Tensor]) -> dict[str, float]:
    """Teacher-forced on each prompt + the teacher's greedy reply: the share of reply tokens that are the
    model's argmax (agreement) and exp(−mean KL(teacher ‖ model)) over the reply tokens."""
    from minispec.kl import kl_divergence

    model.eval()
    agree = kl = count = 0.0
    for prompt, reply in zip(prompts, replies):
        ids = torch.cat([prompt, reply])[None]
        span = slice(len(prompt) - 1, ids.shape[1] - 1)
        t = teacher(input_ids=ids).logits[0, span].float()
        m = t if model is teacher else model(input_ids=ids).logits[0, span].float()
        agree += (m.argmax(-1) == reply).sum().item()
        kl += kl_divergence(t, m, reduction="none").sum().item()
        count += len(reply)
    return {"agreement": agree / count, "exp_neg_kl": math.exp(-kl / count)}


def prefix_share(replies: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Mean over prompts of (tokens before the first difference from the reference reply) / its length."""
    shares = []
    for r, ref in zip(replies, reference):
        n = min(len(r), len(ref))
        diff = (r[:n] != ref[:n]).nonzero()
        shares.append((int(diff[0]) if len(diff) else n) / len(ref))
    return sum(shares) / len(shares)


def chat_suite(teacher, models: dict, prompts: list[torch.Tensor], evalset, n_eval: int,
               max_new_tokens: int = 256, teacher_replies: list[torch.Tensor] | None = None,
               done: dict | None = None, on_row=None) -> dict:
    """The chat scorecard of the module doc for the BF16 `teacher` and each model in `models` (name -> model):
    metrics, recoveries, median recovery and reply-length drift, as `evaluate_models` reports them.

    prompts: MT-Bench first turns (chat template applied). teacher_replies: the teacher's greedy replies to
    them, if already made. done: rows already scored ("bf16" and model names; a resumed run skips them);
    on_row(name, row) is called after each row is scored (a resumable caller saves there)."""
    teacher_replies = teacher_replies or greedy_replies(teacher, prompts, max_new_tokens)
    done = done or {}
    todo = {name: model for name, model in models.items() if name not in done}
    ref = predictions(teacher, evalset, n_eval) if todo or "bf16" not in done else None
    bf16_lengths = torch.tensor([len(r) for r in teacher_replies])
    if "bf16" in done:
        report = {"bf16": done["bf16"]}
    else:
        bf16 = {f"mtbench/{k}": v for k, v in reply_scores(teacher, teacher, prompts, teacher_replies).items()}
        bf16["mtbench/prefix"] = 1.0
        bf16.update({f"eval/{k}": v for k, v in _eval_metrics(ref, ref).items()})
        report = {"bf16": {"metrics": bf16, "mean_reply_length": bf16_lengths.float().mean().item(),
                           "reply_lengths": bf16_lengths.tolist()}}
        if on_row is not None:
            on_row("bf16", report["bf16"])
    bf16 = report["bf16"]["metrics"]
    for name in models:
        if name in done:
            report[name] = done[name]
            continue
        model = todo[name]
        metrics = {f"mtbench/{k}": v for k, v in reply_scores(teacher, model, prompts, teacher_replies).items()}
        own = greedy_replies(model, prompts, max_new_tokens)
        metrics["mtbench/prefix"] = prefix_share(own, teacher_replies)
        metrics.update({f"eval/{k}": v for k, v in _eval_metrics(predictions(model, evalset, n_eval), ref).items()})
        row = score_row(metrics, bf16, torch.tensor([len(r) for r in own]), bf16_lengths)
        report[name] = row
        if on_row is not None:
            on_row(name, row)
    return report


def _eval_metrics(pred: Predictions, reference: Predictions) -> dict[str, float]:
    """accuracy, likelihood and agreement on the eval set (the category split is for code models)."""
    correct = (pred.argmax == pred.targets).float()
    return {"accuracy": correct.mean().item(), "likelihood": pred.logprob.mean().exp().item(),
            "agreement": (pred.argmax == reference.argmax).float().mean().item()}
