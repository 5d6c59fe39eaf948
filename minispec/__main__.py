"""`python -m minispec demo`: speculative decoding on a target with its drafter, with its speed.

By default the real target, SmolLM2-135M-Instruct, answers one MT-Bench question with its DFlash drafter
(`smollm2-135m-dflash`); `--target bolt-mini` runs the shipped toy target on a prompt of its frozen eval set
with the n-gram drafter. The target decides where the prompt comes from (MT-Bench for a chat model, the
eval set otherwise) and which drafter is the default.

Prints the question (or the prompt's tail), then the continuation as a coloured strip that grows cycle by
cycle (green accepted drafts, red struck-through rejected drafts, yellow target corrections, blue bonus
tokens), then τ, the per-position acceptance and the speedup over plain autoregressive decoding measured in
the same run (batch 1); at T = 0 whether the output equals autoregressive decoding's.
"""
from __future__ import annotations

import argparse
import sys

import torch

import minispec as ms
from minispec.bench.timing import timed
from minispec.cli import non_negative_int, positive_int, temperature
from minispec.results import load_result
from minispec.speculative.autoregressive import check_generation_args
from minispec.training import weights_digest
from minispec.viz import AnsiStrip

# The drafter each target runs by default: SmolLM2's own DFlash drafter; on bolt-mini the n-gram drafter,
# the fastest there (its DFlash drafter accepts more, but bolt-mini's forward is too cheap to pay for it).
DEFAULT_DRAFTERS = {"smollm2-135m": "smollm2-135m-dflash", "bolt-mini": "ngram"}
# The MT-Bench question the demo asks SmolLM2 by default (fixed: never chosen by how well it goes).
DEFAULT_QUESTION = 0
# The shipped drafters' acceptance on all of MT-Bench, measured by `python -m minispec.bench dflash`: one question
# is one sample, so the demo sets the whole benchmark beside it.
BENCHMARKS = {"smollm2-135m-dflash": "smollm2-135m-dflash-mtbench"}


def benchmark_line(drafter_name: str, drafter) -> str | None:
    """τ over the whole benchmark from the shipped result of `drafter_name`, or None if none ships for it."""
    if drafter_name not in BENCHMARKS:
        return None
    result = load_result(BENCHMARKS[drafter_name])
    rows = [r for r in result["rows"] if "policy" in r]
    if rows[0]["drafter_weights"] != weights_digest(drafter.model):
        raise ValueError(f"minispec/results/{BENCHMARKS[drafter_name]}.json was measured with other weights than "
                         f"the shipped {drafter_name}: rerun `{result['command']}`")
    taus = ", ".join(f"{r['tau']:.2f} at T = {r['T']:g}" + ("" if r["policy"] == "both" else f" ({r['policy']})")
                     for r in rows)
    return f"--- over all {rows[0]['prompts']} MT-Bench first turns ({result['command']}): τ = {taus}"


def load_prompt(tokenizer, index: int | None) -> tuple[torch.Tensor, str, str]:
    """(prompt ids [T], its title, the text to show): an MT-Bench first turn for a chat target, a prompt of the
    frozen eval set otherwise."""
    if tokenizer.chat_template is not None:
        bench = ms.load_mtbench(tokenizer)
        index = DEFAULT_QUESTION if index is None else index
        if not 0 <= index < len(bench):
            raise ValueError(f"--question {index}: MT-Bench has {len(bench)} questions, numbered 0..{len(bench) - 1}")
        return bench.prompts[index], f"MT-Bench question #{index}, {bench.categories[index]}", bench.questions[index]
    prompts = ms.load_evalset().prompts
    index = 0 if index is None else index
    if not 0 <= index < len(prompts):
        raise ValueError(f"--prompt {index}: the frozen eval set has {len(prompts)} prompts, numbered "
                         f"0..{len(prompts) - 1}")
    return prompts[index], f"frozen eval set #{index}, last 300 characters", tokenizer.decode(prompts[index])[-300:]


def demo(args) -> None:
    torch.set_num_threads(args.threads)
    drafter_name = args.drafter or DEFAULT_DRAFTERS.get(str(args.target), "ngram")
    try:
        model, tok = ms.load_target(args.target)
        prompt, title, shown = load_prompt(tok, args.prompt)
        drafter = ms.load_drafter(drafter_name, model, policy=args.policy)
        check_generation_args(model, prompt, args.max_new_tokens, args.temperature, None, None, None)
    except (ModuleNotFoundError, FileNotFoundError, ValueError) as err:
        # A missing package or checkpoint, a bad name or index, or a prompt too long for the model: the
        # message names the fix.
        sys.exit(f"python -m minispec demo: {err}")
    print(f"{args.target} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), "
          f"drafter {drafter_name}, K={drafter.num_draft_tokens}, T={args.temperature}")
    print(f"--- prompt ({title}) ---")
    print(shown)
    print("--- speculative continuation ---")
    strip = AnsiStrip(tok)
    strip.legend()
    spec_s, spec = timed(lambda: ms.speculative_generate(
        model, drafter, prompt, args.max_new_tokens, temperature=args.temperature,
        generator=torch.Generator().manual_seed(0), on_cycle=strip), 1, warmup=0)
    strip.finish()

    ar_s, ar = timed(lambda: ms.autoregressive_generate(
        model, prompt, args.max_new_tokens, temperature=args.temperature,
        generator=torch.Generator().manual_seed(0)), 1, warmup=0)
    n_spec, n_ar = int(spec.lengths[0]), int(ar.lengths[0])
    print(f"--- τ = {spec.stats.tau:.2f} tokens per target forward; per-position acceptance "
          f"{[round(x, 2) for x in spec.stats.per_position.tolist()]}")
    print(f"--- speculative {n_spec / spec_s:.1f} tokens/s vs autoregressive {n_ar / ar_s:.1f} tokens/s: "
          f"{(n_spec / spec_s) / (n_ar / ar_s):.2f}x (batch 1, {torch.get_num_threads()} CPU threads)")
    if args.temperature == 0:
        same = torch.equal(spec.tokens[0, :n_spec], ar.tokens[0, :n_ar])
        print(f"--- greedy speculative output {'equals' if same else 'DIFFERS FROM'} autoregressive output")
    whole = benchmark_line(drafter_name, drafter)
    if whole is not None:
        print(whole)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="speculative decoding of SmolLM2-135M-Instruct on an MT-Bench question (or of "
                                    "bolt-mini on its eval set), with tokens/s vs AR")
    d.add_argument("--target", default="smollm2-135m", help='"smollm2-135m", "bolt-mini" or a local HF folder')
    d.add_argument("--drafter", default=None,
                   help=f"a drafter name or folder; default per target {DEFAULT_DRAFTERS}, else ngram")
    d.add_argument("--policy", choices=["argmax", "sample"], default=None,
                   help="a DFlash drafter's drafting policy (default argmax; both exact)")
    d.add_argument("--question", "--prompt", dest="prompt", type=non_negative_int, default=None,
                   help=f"MT-Bench question for a chat target (default {DEFAULT_QUESTION}), else index into the "
                        "frozen eval set (default 0)")
    d.add_argument("--max-new-tokens", type=positive_int, default=128)
    d.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    d.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    demo(p.parse_args(argv))


if __name__ == "__main__":
    main()
