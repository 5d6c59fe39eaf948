"""Token streams of the corpus splits, and seeded random training windows over them."""
from __future__ import annotations

import numpy as np
import torch

from minispec.files import cache_dir
from minispec.targets import corpus


def token_stream(split: str, tokenizer) -> torch.Tensor:
    """All files of a split as one stream of ids: `<bos> file <eos> <bos> file <eos> ...`.

    Cached on disk by the split's data hash, so a second run (or a resumed one) skips tokenizing.
    """
    files = corpus.iter_files(split)
    key = corpus.data_hash(files)[:16]
    path = cache_dir() / f"{split}-{key}-v{tokenizer.vocab_size}.npy"
    if path.exists():
        return torch.from_numpy(np.load(path).astype(np.int64))
    ids: list[int] = []
    for f in files:
        ids.append(tokenizer.bos_token_id)
        # A whole file is longer than the model's context; it is cut into windows later, so the tokenizer's
        # warning about too-long sequences would only alarm a notebook reader.
        ids.extend(tokenizer(f.text, verbose=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    arr = np.asarray(ids, dtype=np.int16 if tokenizer.vocab_size < 2**15 else np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, arr)
    return torch.from_numpy(arr.astype(np.int64))


def random_windows(stream: torch.Tensor, batch: int, length: int, seed: int, step: int) -> torch.Tensor:
    """`[batch, length]` windows at random offsets; the same (seed, step) always gives the same batch,
    which is what makes a resumed run identical to an uninterrupted one."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - length, (batch,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def sequential_windows(stream: torch.Tensor, length: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping `[n, length]` windows from the start of the stream (for evaluation)."""
    n = len(stream) // length
    if max_windows is not None:
        n = min(n, max_windows)
    return stream[: n * length].view(n, length)
