"""The frozen evaluation set: prompts from held-out test files, shipped as token ids.

Every τ, accuracy and speed figure in minispec is measured on these prompts, so every machine
measures the same thing whatever Python version (and so whatever stdlib) it has.
Build (once, by `python -m minispec.targets.evalset build --out minispec/checkpoints/evalset`; without
--out it goes to the user cache): for each test-split file, cut prompts of a seeded random length in
[64, 256] tokens at spaced offsets, each followed by the next 128 tokens of the file as its reference
continuation.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minispec import training
from minispec.files import cache_dir
from minispec.manifest import check_manifest
from minispec.targets import corpus
from minispec.targets.tokenizer import load_shipped_tokenizer

FOLDER = Path(__file__).resolve().parents[1] / "checkpoints" / "evalset"
MIN_PROMPT, MAX_PROMPT, CONTINUATION = 64, 256, 128
PROMPTS_PER_FILE = 4
SEED = 0


@dataclass
class EvalSet:
    prompts: list[torch.Tensor]  # each [T_i], 64 <= T_i <= 256
    continuations: torch.Tensor  # [N, 128], the file's own next tokens
    files: list[str]  # source file of each prompt

    def __len__(self) -> int:
        return len(self.prompts)


def build(tokenizer, n_max: int = 320) -> tuple[EvalSet, dict]:
    g = torch.Generator().manual_seed(SEED)
    prompts, conts, files = [], [], []
    test_files = corpus.iter_files("test")
    for f in test_files:
        ids = torch.tensor([tokenizer.bos_token_id] + tokenizer(f.text)["input_ids"])
        span = MAX_PROMPT + CONTINUATION
        if len(ids) < span:
            continue
        # Spaced offsets so that prompts of one file do not overlap.
        n = min(PROMPTS_PER_FILE, len(ids) // span)
        for j in range(n):
            length = int(torch.randint(MIN_PROMPT, MAX_PROMPT + 1, (1,), generator=g))
            start = j * (len(ids) // n)
            prompts.append(ids[start : start + length])
            conts.append(ids[start + length : start + length + CONTINUATION])
            files.append(f.relpath)
    order = torch.randperm(len(prompts), generator=g)[:n_max].sort().values.tolist()
    es = EvalSet([prompts[i] for i in order], torch.stack([conts[i] for i in order]), [files[i] for i in order])
    meta = {"test_data_sha256": corpus.data_hash(test_files), "seed": SEED}
    return es, meta


def save(es: EvalSet, meta: dict, folder: Path) -> None:
    """Write the set into `folder` (an existing one is replaced only once the new one is complete)."""
    training.save_atomically(folder, lambda tmp: _write(es, meta, tmp))


def _write(es: EvalSet, meta: dict, folder: Path) -> None:
    padded = torch.zeros(len(es), MAX_PROMPT, dtype=torch.int16)
    for i, p in enumerate(es.prompts):
        padded[i, : len(p)] = p
    lengths = torch.tensor([len(p) for p in es.prompts], dtype=torch.int16)
    save_file({"prompts": padded, "prompt_lengths": lengths, "continuations": es.continuations.to(torch.int16)},
              folder / "eval.safetensors")
    meta = dict(meta, command="python -m minispec.targets.evalset build", files=es.files, n=len(es))
    (folder / "evalset.json").write_text(json.dumps(meta, indent=0))


@torch.no_grad()
def score(model, es: EvalSet | None = None, limit: int | None = None) -> dict[str, float]:
    """Next-token loss (nats) and argmax accuracy of `model` on the continuations, given each prompt.

    Every continuation token is predicted from the true text before it (teacher forcing), so this
    measures the model, not a decoding strategy.
    """
    es = es or load_evalset()
    total_loss, correct, count = 0.0, 0, 0
    for prompt, cont in list(zip(es.prompts, es.continuations))[:limit]:
        ids = torch.cat([prompt, cont])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        total_loss += torch.nn.functional.cross_entropy(logits, cont, reduction="sum").item()
        correct += (logits.argmax(-1) == cont).sum().item()
        count += len(cont)
    return {"loss": total_loss / count, "accuracy": correct / count, "tokens": count}


def load_evalset(folder: Path = FOLDER) -> EvalSet:
    check_manifest(folder)
    t = load_file(folder / "eval.safetensors")
    lengths = t["prompt_lengths"].long().tolist()
    prompts = [t["prompts"][i, :n].long() for i, n in enumerate(lengths)]
    files = json.loads((folder / "evalset.json").read_text())["files"]
    return EvalSet(prompts, t["continuations"].long(), files)


def main(argv: list[str] | None = None) -> None:
    """`python -m minispec.targets.evalset build` writes the frozen set (once);
    `python -m minispec.targets.evalset score bolt-mini` writes the model's scores to eval.json. Both write into
    `--out`, by default in the user cache; the shipped files are rebuilt with `--out minispec/checkpoints/evalset`
    and `--out minispec/checkpoints/<model>` (the model's other files are kept)."""
    import argparse
    import shlex

    p = argparse.ArgumentParser(prog="python -m minispec.targets.evalset")
    p.add_argument("command", choices=["build", "score"])
    p.add_argument("model", nargs="?", default="bolt-mini")
    p.add_argument("--out", type=Path, help="build: the eval set's folder (default: ~/.cache/minispec/evalset); "
                                            "score: the folder that gets eval.json (default: "
                                            "~/.cache/minispec/models/<model>)")
    a = p.parse_args(argv)
    if a.command == "build":
        out = a.out or cache_dir() / "evalset"
        tok = load_shipped_tokenizer()
        es, meta = build(tok)
        save(es, meta, out)
        print(f"{len(es)} prompts from {len(set(es.files))} files -> {out}; load it with ms.load_evalset({str(out)!r})")
        return
    from minispec.targets.load import load_target

    out = a.out or training.default_out(Path(a.model).name)
    model, _ = load_target(a.model)
    result = dict(score(model), first_40=score(model, limit=40))
    record = dict(result, command="python -m minispec.targets.evalset " + shlex.join(argv or sys.argv[1:]),
                  what="teacher-forced next-token loss (nats) and argmax accuracy on the 128-token continuations "
                       "of the frozen eval set")
    training.save_atomically(out, lambda tmp: (tmp / "eval.json").write_text(json.dumps(record, indent=1)),
                             copy_of=out)
    print(result)
    print(f"wrote {out / 'eval.json'}")


if __name__ == "__main__":
    main()
