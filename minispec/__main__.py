"""`python -m minispec demo`: speculative decoding on the shipped model, with its speed.

Prints the prompt's tail, then the continuation as a coloured strip that grows cycle by cycle
(green accepted drafts, red struck-through rejected drafts, yellow target corrections, blue bonus
tokens), then τ and the speedup over plain autoregressive decoding measured in the same run.
"""
from __future__ import annotations

import argparse

import torch

import minispec as ms
from minispec.bench.timing import timed
from minispec.viz import AnsiStrip


def demo(args) -> None:
    torch.set_num_threads(args.threads)
    model, tok = ms.load_target(args.model)
    prompt = ms.load_evalset().prompts[args.prompt]
    drafter = ms.load_drafter(args.drafter, model)
    print(f"{args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), "
          f"drafter {args.drafter}, K={drafter.num_draft_tokens}, T={args.temperature}")
    print(f"--- prompt (frozen eval set #{args.prompt}, last 300 characters) ---")
    print(tok.decode(prompt)[-300:])
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="speculative decoding on the shipped bolt-mini, with tokens/s vs AR")
    d.add_argument("--model", default="bolt-mini")
    d.add_argument("--drafter", default="ngram",
                   help='"ngram" (the fastest on bolt-mini today), "bolt-nano" or a draft-model folder')
    d.add_argument("--prompt", type=int, default=0, help="index into the frozen eval set")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--threads", type=int, default=torch.get_num_threads())
    demo(p.parse_args(argv))


if __name__ == "__main__":
    main()
