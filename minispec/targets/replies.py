"""Replies written by a target model: the training data of drafters that must imitate that target.

A drafter is accepted when it predicts what the *target* would say, not what the corpus says. DFlash
regenerates its training responses with the target (research/dflash.md §4), and MTP boosting trains
on replies sampled from the backbone at temperature 1 (research/mtp_edu.md §1). Both come from here:

    prompt  = a seeded window of `prompt_len` tokens from a corpus split
    reply   = the target's continuation of `reply_len` tokens at `temperature` (0 = greedy)
    sample  = prompt ++ reply, with loss_mask = 1 on reply tokens (up to and including an EOS)

Replies are cached on disk, keyed by the target's weights and every argument, so a resumed training
run (or a second drafter) does not pay for generation twice.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from minispec.speculative.autoregressive import autoregressive_generate, special_ids
from minispec.targets import data


@dataclass
class Replies:
    input_ids: torch.Tensor  # [n, prompt_len + reply_len] prompt then reply, pad after an EOS
    loss_mask: torch.Tensor  # [n, prompt_len + reply_len] 1 on reply tokens, 0 on the prompt and padding

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, size: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`size` rows drawn by (seed, step), so a resumed run sees the same batches."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        rows = torch.randint(0, len(self), (size,), generator=g)
        return self.input_ids[rows], self.loss_mask[rows]


def replies_dir() -> Path:
    return data.cache_dir() / "replies"


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def generate_replies(model, tokenizer, num: int, prompt_len: int, reply_len: int, temperature: float = 0.0,
                     split: str = "train", seed: int = 0, batch_size: int = 64, cache: bool = True) -> Replies:
    """`num` prompts from `split` (seeded windows) and the model's replies to them; see the module doc."""
    if num < 1 or prompt_len < 1 or reply_len < 1:
        raise ValueError(f"num, prompt_len and reply_len must be >= 1, got {num}, {prompt_len}, {reply_len}")
    key = f"{weights_digest(model)}-{split}-{num}-{prompt_len}-{reply_len}-{temperature}-{seed}"
    path = replies_dir() / f"{key}.pt"
    if cache and path.exists():
        return Replies(**torch.load(path))
    stream = data.token_stream(split, tokenizer)
    prompts = data.random_windows(stream, num, prompt_len, seed, step=-7)
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    ids, masks = [], []
    for start in tqdm(range(0, num, batch_size), desc=f"replies T={temperature}"):
        chunk = prompts[start: start + batch_size]
        out = autoregressive_generate(model, chunk, reply_len, temperature=temperature, generator=generator)
        reply = torch.full((len(chunk), reply_len), special_ids(model)[0], dtype=torch.long)
        reply[:, : out.tokens.shape[1]] = out.tokens
        real = torch.arange(reply_len)[None, :] < out.lengths[:, None]
        ids.append(torch.cat([chunk, reply], dim=1))
        masks.append(torch.cat([torch.zeros_like(chunk), real.long()], dim=1))
    replies = Replies(torch.cat(ids), torch.cat(masks))
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": replies.input_ids, "loss_mask": replies.loss_mask}, path)
    return replies
