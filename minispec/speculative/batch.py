"""Ragged prompt batches: left padding, attention masks and position ids.

Prompts of different lengths are left-padded so that every sequence's next token sits in the same
column. Position ids count real tokens only, so a padded sequence sees exactly the positions (and,
under a sliding window, exactly the keys) it would see alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # [B, T] left-padded
    attention_mask: torch.Tensor  # [B, T] 1 for real tokens
    lengths: torch.Tensor  # [B] real prompt lengths

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


def as_prompt_batch(input_ids, pad_token_id: int) -> PromptBatch:
    """Accept a `[B, T]` LongTensor, a 1-D tensor (one prompt) or a list of 1-D tensors / int lists."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, T], got shape {tuple(input_ids.shape)}")
        prompts = list(input_ids)
    else:
        prompts = [torch.as_tensor(p, dtype=torch.long) for p in input_ids]
    if not prompts:
        raise ValueError("empty batch: no prompts given")
    for i, p in enumerate(prompts):
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"empty prompt at batch index {i}: every prompt needs at least one token")
        if p.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"prompt {i} has dtype {p.dtype}; token ids must be integers")
    lengths = torch.tensor([len(p) for p in prompts])
    T = int(lengths.max())
    ids = torch.full((len(prompts), T), pad_token_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros(len(prompts), T, dtype=torch.long, device=prompts[0].device)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    return PromptBatch(ids, mask, lengths)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` positions of real tokens counted from 0; padding gets 1 (never read), as in HF generate."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def check_vocab_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got range [{int(ids.min())}, {int(ids.max())}]")
