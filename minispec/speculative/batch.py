"""Ragged prompt batches: left padding, attention masks and position ids.

Prompts of different lengths are left-padded so that every sequence's next token sits in the same
column. Position ids count real tokens only, so a padded sequence sees exactly the positions (and,
under a sliding window, exactly the keys) it would see alone.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral

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
    """Accept a `[B, T]` LongTensor, one prompt (a 1-D tensor or a flat list of ids), or a list of prompts
    (1-D tensors or lists of ids) of any lengths.

    TypeError when the input is not token ids (text, floats, a tokenizer's whole output); ValueError for an
    empty batch, an empty prompt or a wrong shape.
    """
    prompts = [_as_prompt(p, i) for i, p in enumerate(_split_prompts(input_ids))]
    if not prompts:
        raise ValueError("empty batch: no prompts given")
    for i, p in enumerate(prompts):
        if p.numel() == 0:
            raise ValueError(f"empty prompt at batch index {i}: every prompt needs at least one token")
    lengths = torch.tensor([len(p) for p in prompts])
    T = int(lengths.max())
    ids = torch.full((len(prompts), T), pad_token_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros(len(prompts), T, dtype=torch.long, device=prompts[0].device)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    return PromptBatch(ids, mask, lengths)


def _split_prompts(input_ids) -> list:
    """The prompts of `input_ids`, each still a tensor or a sequence of ids."""
    if hasattr(input_ids, "__array__") and not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids)  # a NumPy array
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            return [input_ids]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, T] or one prompt [T], got shape {tuple(input_ids.shape)}")
        return list(input_ids)
    if isinstance(input_ids, (str, bytes)):
        raise TypeError(f"input_ids must be token ids, got text {input_ids[:40]!r}: tokenize it first, "
                        "e.g. tokenizer(text, return_tensors='pt').input_ids")
    if isinstance(input_ids, Mapping):
        raise TypeError("input_ids must be token ids, got a mapping (a tokenizer's whole output?): pass its "
                        "['input_ids']")
    if not isinstance(input_ids, Sequence):
        raise TypeError(f"input_ids must be a tensor or a list of prompts, got {type(input_ids).__name__}")
    if input_ids and not any(_is_prompt(p) for p in input_ids):
        return [input_ids]  # a flat list of ids is one prompt, as a 1-D tensor is
    return list(input_ids)


def _is_prompt(p) -> bool:
    return hasattr(p, "__array__") or (isinstance(p, Sequence) and not isinstance(p, (str, bytes)))


def _as_prompt(p, i: int) -> torch.Tensor:
    """Prompt i as a 1-D LongTensor."""
    if hasattr(p, "__array__"):
        p = torch.as_tensor(p)
        if p.dim() != 1:
            raise ValueError(f"prompt {i} must be 1-D token ids [T], got shape {tuple(p.shape)}")
        if p.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"prompt {i} has dtype {p.dtype}; token ids must be integers")
        return p.long()
    if not _is_prompt(p):
        raise TypeError(f"prompt {i} must be a 1-D tensor or a list of token ids, got {type(p).__name__} {p!r:.60}")
    bad = next((t for t in p if isinstance(t, bool) or not isinstance(t, Integral)), None)
    if bad is not None:
        hint = ": tokenize the text first" if isinstance(bad, str) else ""
        raise TypeError(f"prompt {i} holds {type(bad).__name__} {bad!r:.60}; token ids must be ints{hint}")
    if p and not -2**63 <= min(p) <= max(p) < 2**63:
        raise ValueError(f"prompt {i} holds a token id outside int64 ({max(p, key=abs)}): no vocabulary has it")
    return torch.tensor(p, dtype=torch.long)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` positions of real tokens counted from 0; padding gets 1 (never read), as in HF generate."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def check_vocab_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got range [{int(ids.min())}, {int(ids.max())}]")
