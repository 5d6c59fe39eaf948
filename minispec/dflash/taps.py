"""The target's hidden states over a reply set, computed once and kept in the user cache.

`python -m minispec.dflash.taps --target smollm2-135m` (after `python -m minispec.dflash.data`):

    for every shard of the reply set (minispec/datasets/<target>-sharegpt/<split>-NNNNN.npz):
        run the frozen target once over each sample (prompt ++ reply) and keep, one row per token:
        <split>-NNNNN.taps.npy    [N, n_taps * H]  F, the outputs of the tapped layers (the drafter's input)
        <split>-NNNNN.final.npy   [N, H]           what the target's head reads (after its final norm): the
                                                   target's logits over any vocabulary are one matmul away,
                                                   so a drafter can be distilled without storing 49 k logits
                                                   a token

Both are bfloat16 bits (numpy has no bfloat16, so they are stored as uint16) and are memory-mapped when a
drafter trains, so a set larger than the machine's memory trains from disk. The folder is keyed by the
target's weights, the tapped layers and the precision the target ran in; a shard already there is never
computed again, so the job resumes. The replies are the data set's: committed, never recomputed.

Why a second pass rather than keeping the taps while the replies were generated: measured on one CPU thread in
bfloat16, SmolLM2-135M generated 101 reply tokens/s (4.3 hours for the set) and this pass reads about 330
tokens/s, prompts included (about 1.7 hours for all 61 shards): keeping them would have saved that 40 %, once,
but it ties the taps to one choice of layers (another tap set needs this pass anyway) and would have put
15 GB on every machine that only wants the 5 MB of replies.
"""
from __future__ import annotations

import argparse
import bisect
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from minispec.dflash import data
from minispec.dflash.config import smollm2_dflash_config
from minispec.files import cache_dir
from minispec.targets.load import load_target
from minispec.targets.replies import batch_rows
from minispec.training import weights_digest

TOKENS_PER_BATCH = 4096  # padded tokens per target forward


def taps_dir(replies: Path, layer_ids: list[int]) -> Path:
    """The cache folder of the taps at `layer_ids` over the reply set `replies`, computed by the target that wrote
    the replies, in the precision it wrote them in (both as the set's dataset.json records them)."""
    made = json.loads((Path(replies) / "dataset.json").read_text())
    layers = "_".join(map(str, layer_ids))
    return cache_dir() / "taps" / f"{made['target_weights']}-{made['settings']['dtype']}-{layers}"


def to_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bits(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x).view(np.int16)).view(torch.bfloat16)  # a copy: memory maps are read-only


@torch.no_grad()
def shard_states(target, layer_ids: list[int], rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (token ids of each sample) -> (F [N, n_taps * H], final [N, H]), N = all tokens, in row order.

    Rows run in batches of similar length, right-padded: a causal model's real tokens never see the padding
    after them, so a row's states do not depend on the rows batched with it."""
    head_input = []
    hook = target.get_output_embeddings().register_forward_hook(lambda m, args, out: head_input.append(args[0]))
    starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    H = target.config.hidden_size
    taps = torch.zeros(int(starts[-1]), len(layer_ids) * H, dtype=torch.bfloat16)
    final = torch.zeros(int(starts[-1]), H, dtype=torch.bfloat16)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    try:
        while order:
            width = len(rows[order[-1]])
            batch, order = order[-max(1, TOKENS_PER_BATCH // width):], order[: -max(1, TOKENS_PER_BATCH // width)]
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for j, i in enumerate(batch):
                ids[j, : len(rows[i])] = torch.from_numpy(rows[i])
            head_input.clear()
            out = target(input_ids=ids, output_hidden_states=True)
            tapped = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
            for j, i in enumerate(batch):
                n = len(rows[i])
                taps[starts[i]: starts[i] + n] = tapped[j, :n].to(torch.bfloat16)
                final[starts[i]: starts[i] + n] = head_input[0][j, :n].to(torch.bfloat16)
    finally:
        hook.remove()
    return taps, final


def build(target, layer_ids: list[int], replies: Path, out: Path, splits=data.SPLITS,
          train_shards: slice = slice(None)) -> None:
    """Compute the missing shards' taps of `replies` (a data set folder) into `out`, held-out shards first (all of
    them: every run is scored on them), then the train shards `train_shards`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [p for split in splits
             for p in sorted(replies.glob(f"{split}-*.npz"))[train_shards if split == "train" else slice(None)]]
    if not paths:
        raise FileNotFoundError(f"no reply shards in {replies}: make them with `python -m minispec.dflash.data`")
    todo = [p for p in paths if not (out / f"{p.stem}.final.npy").exists()]
    tokens = {p: len(data.read_shard(p)["tokens"]) for p in todo}
    bar = tqdm(total=sum(tokens.values()), unit="tok", desc=f"target taps ({len(paths) - len(todo)} of "
                                                            f"{len(paths)} shards done)")
    for path in todo:
        started = time.perf_counter()
        taps, final = shard_states(target, layer_ids, data.rows_of(data.read_shard(path)))
        for name, array in ((f"{path.stem}.taps.npy", taps), (f"{path.stem}.final.npy", final)):
            with open(out / f"{name}.tmp", "wb") as f:  # .final last: its presence marks a finished shard
                np.save(f, to_bits(array))
            (out / f"{name}.tmp").replace(out / name)
        bar.update(tokens[path])
        disk = sum(f.stat().st_size for f in out.iterdir()) / 1e9
        bar.set_postfix_str(f"{path.name} in {time.perf_counter() - started:.0f} s, disk {disk:.1f} GB")
    bar.close()
    (out / "taps.json").write_text(json.dumps({"replies": str(replies), "layer_ids": layer_ids,
                                               "dtype": str(target.dtype), "target_weights": weights_digest(target)}))


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] prompt ++ reply, right-padded
    loss_mask: torch.Tensor  # [B, S] 1 on reply tokens
    features: torch.Tensor  # [B, S, n_taps * H] bf16
    final: torch.Tensor  # [B, S, H] bf16: the target head's input at each position
    temperatures: torch.Tensor  # [B] the temperature each reply was drawn at


class TapSet:
    """The samples of one split of a reply set with their stored taps, read from disk (memory-mapped)."""

    def __init__(self, replies: Path, taps: Path, split: str, shards: slice = slice(None)):
        paths = sorted(Path(replies).glob(f"{split}-*.npz"))[shards]
        if not paths:
            raise FileNotFoundError(f"{replies} holds no {split} shards {shards.start or 0}:{shards.stop or ''}")
        missing = [p.name for p in paths if not (Path(taps) / f"{p.stem}.final.npy").exists()]
        if missing:
            raise FileNotFoundError(f"{taps} lacks the taps of {missing}: compute them with "
                                    "`python -m minispec.dflash.taps`")
        self.tokens, self.taps, self.final = [], [], []
        self.starts, self.prompt, self.reply, self.temperature, self.first = [], [], [], [], [0]
        for p in paths:
            shard = data.read_shard(p)
            self.tokens.append(shard["tokens"])
            self.taps.append(np.load(Path(taps) / f"{p.stem}.taps.npy", mmap_mode="r"))
            self.final.append(np.load(Path(taps) / f"{p.stem}.final.npy", mmap_mode="r"))
            lengths = shard["prompt_lengths"] + shard["reply_lengths"]
            self.starts.append(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
            self.prompt.append(shard["prompt_lengths"])
            self.reply.append(shard["reply_lengths"])
            self.temperature.append(shard["temperatures"])
            self.first.append(self.first[-1] + len(lengths))

    def __len__(self) -> int:
        return self.first[-1]

    @property
    def reply_tokens(self) -> int:
        return int(sum(r.sum() for r in self.reply))

    def reply_token_ids(self) -> torch.Tensor:
        """[n] every reply token of the split, in order."""
        return torch.cat([torch.from_numpy(t[int(a + P): int(a + P + R)].astype(np.int64))
                          for t, starts, prompt, reply in zip(self.tokens, self.starts, self.prompt, self.reply)
                          for a, P, R in zip(starts, prompt, reply)])

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, sample within it) of sample i of the split."""
        s = bisect.bisect_right(self.first, i) - 1
        return s, i - self.first[s]

    def rows(self, index: list[int], pad_id: int = 0) -> Batch:
        """The samples `index` as one right-padded batch."""
        where = [self.locate(i) for i in index]
        lengths = [int(self.prompt[s][j] + self.reply[s][j]) for s, j in where]
        B, S = len(index), max(lengths)
        ids = torch.full((B, S), pad_id, dtype=torch.long)
        mask = torch.zeros(B, S, dtype=torch.long)
        feats = torch.zeros(B, S, self.taps[0].shape[1], dtype=torch.bfloat16)
        final = torch.zeros(B, S, self.final[0].shape[1], dtype=torch.bfloat16)
        for b, ((s, j), n) in enumerate(zip(where, lengths)):
            a = int(self.starts[s][j])
            ids[b, :n] = torch.from_numpy(self.tokens[s][a: a + n].astype(np.int64))
            mask[b, int(self.prompt[s][j]): n] = 1
            feats[b, :n] = from_bits(self.taps[s][a: a + n])
            final[b, :n] = from_bits(self.final[s][a: a + n])
        temps = torch.tensor([float(self.temperature[s][j]) for s, j in where])
        return Batch(ids, mask, feats, final, temps)

    def batch(self, size: int, seed: int, step: int, pad_id: int = 0) -> Batch:
        """`size` samples drawn by (seed, step), so a resumed run sees the same batches."""
        return self.rows(batch_rows(len(self), size, seed, step).tolist(), pad_id)

    def tap_rms(self, num_rows: int = 256, seed: int = 0) -> torch.Tensor:
        """[n_taps * H] the root mean square of each feature over `num_rows` seeded samples, position 0 left out
        (the first position's states are an attention sink, hundreds of times larger than the rest)."""
        g = torch.Generator().manual_seed(seed)
        picked = torch.randint(0, len(self), (min(num_rows, len(self)),), generator=g).tolist()
        where = [self.locate(i) for i in picked]
        x = torch.cat([from_bits(self.taps[s][int(self.starts[s][j]) + 1:
                                              int(self.starts[s][j] + self.prompt[s][j] + self.reply[s][j])])
                       for s, j in where]).float()
        return x.pow(2).mean(0).sqrt()

def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec.dflash.taps", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m", choices=["smollm2-135m"])
    p.add_argument("--replies", type=Path, help="the reply set (default: minispec/datasets/<target>-sharegpt)")
    p.add_argument("--train-shards", help="only these train shards: N (the first N) or A:B (default: all; the held-out "
                                          "shards always)")
    p.add_argument("--layers", type=int, nargs="+", help="tapped layers (default: the shipped drafter's)")
    a = p.parse_args(argv)
    try:
        train_shards = data.shard_slice(a.train_shards) if a.train_shards is not None else slice(None)
    except ValueError as e:
        p.error(str(e))
    replies = a.replies or data.DATASETS / f"{a.target}-sharegpt"
    made = json.loads((replies / "dataset.json").read_text())
    target, _ = load_target(a.target, dtype=getattr(torch, made["settings"]["dtype"]))
    target.eval()
    if weights_digest(target) != made["target_weights"]:
        raise ValueError(f"{replies} was written by other target weights ({made['target_weights']}) than "
                         f"{a.target}'s ({weights_digest(target)}): its taps would not be the replies' own")
    layers = a.layers or smollm2_dflash_config().target_layer_ids
    out = taps_dir(replies, layers)
    build(target, layers, replies, out, train_shards=train_shards)
    print(f"{out}: {sum(f.stat().st_size for f in out.iterdir()) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
