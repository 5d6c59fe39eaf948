"""`python -m minispec demo`: the main job on the shipped model, with its speed."""
from __future__ import annotations

import argparse
import time

import torch

import minispec as ms


def demo(args) -> None:
    model, tok = ms.load_target(args.model)
    prompt = ms.load_evalset().prompts[args.prompt]
    torch.manual_seed(0)
    start = time.perf_counter()
    out = ms.autoregressive_generate(model, prompt, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, generator=torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - start
    n = int(out.lengths[0])
    print(f"--- prompt (eval set #{args.prompt}, last 400 chars) ---")
    print(tok.decode(prompt)[-400:])
    print(f"--- {args.model}, autoregressive, T={args.temperature} ---")
    print(tok.decode(out.tokens[0, :n]))
    print(f"--- {n} tokens in {seconds:.2f} s: {n / seconds:.1f} tokens/s "
          f"(batch 1, {torch.get_num_threads()} CPU threads) ---")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="generate from the shipped bolt-mini and report tokens/s")
    d.add_argument("--model", default="bolt-mini")
    d.add_argument("--prompt", type=int, default=0, help="index into the frozen eval set")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    demo(args)


if __name__ == "__main__":
    main()
