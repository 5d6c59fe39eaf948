"""Autoregressive decoding with a KV cache: the baseline every speculative method must equal.

One target forward per new token, through the same target adapter the speculative loop drives
(`minispec.speculative.target`), so a Hugging Face model and minispec's own `HybridLM` decode by the
same code. Greedy output equals `model.generate(do_sample=False)` token for token; sampled output is
reproducible under a seeded `torch.Generator`.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import torch

from minispec.speculative import sampling
from minispec.speculative.batch import PromptBatch, as_prompt_batch, check_vocab_ids
from minispec.speculative.target import check_target, max_positions, target_adapter


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, n] new tokens, padded with pad_token_id after a sequence ends
    lengths: torch.Tensor  # [B] new tokens per sequence (an emitted EOS counts)


def special_ids(model) -> tuple[int, int | None]:
    """(pad id, eos id) from the model's generation config."""
    gc = model.generation_config
    eos = gc.eos_token_id[0] if isinstance(gc.eos_token_id, list) else gc.eos_token_id
    pad = gc.pad_token_id if gc.pad_token_id is not None else model.config.pad_token_id
    return (pad if pad is not None else 0), eos


@dataclass
class GenerationInputs:
    """What `check_generation_args` hands a decoding loop once everything is checked."""
    batch: PromptBatch  # the prompts, left-padded
    pad_id: int
    eos_id: int | None


def check_generation_args(model, input_ids, max_new_tokens: int, temperature: float, top_k, top_p,
                          generator) -> GenerationInputs:
    """Everything both decoding loops check before any work, in one place: TypeError for an argument of the
    wrong type, ValueError for a bad value, each naming the argument.

    max_new_tokens is an int >= 1 (a bool is not); prompt + max_new_tokens must fit the model's positions
    (`config.max_position_embeddings`): past them a model decodes positions it was never trained on.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral):
        raise TypeError(f"max_new_tokens must be a positive int, got {type(max_new_tokens).__name__} "
                        f"{max_new_tokens!r}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    sampling.check_sampling_args(temperature, top_k, top_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    check_target(model)
    pad_id, eos_id = special_ids(model)
    batch = as_prompt_batch(input_ids, pad_id)
    check_vocab_ids(batch.input_ids, model.config.vocab_size)
    limit = max_positions(model.config)
    longest = int(batch.lengths.max())
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} "
                         f"positions, but the model has {limit} (config.max_position_embeddings): shorten the "
                         "prompt or ask for fewer tokens")
    return GenerationInputs(batch, pad_id, eos_id)


@torch.no_grad()
def autoregressive_generate(model, input_ids, max_new_tokens: int, temperature: float = 0.0,
                            top_k: int | None = None, top_p: float | None = None,
                            generator: torch.Generator | None = None) -> Generation:
    """Decode `max_new_tokens` tokens (fewer if every sequence hits EOS).

    input_ids: `[B, T]` LongTensor, one prompt (1-D tensor or list of ids) or a list of prompts of different
    lengths (left-padded here). Arguments are checked before any work (`check_generation_args`).
    """
    args = check_generation_args(model, input_ids, max_new_tokens, temperature, top_k, top_p, generator)
    batch, pad_id, eos_id = args.batch, args.pad_id, args.eos_id
    target = target_adapter(model)
    logits = target.prefill(batch).logits[:, -1]

    B = batch.size
    finished = torch.zeros(B, dtype=torch.bool, device=batch.input_ids.device)
    new = []
    for _ in range(max_new_tokens):
        token = sampling.next_token(logits, temperature, top_k, top_p, generator)
        token = token.masked_fill(finished, pad_id)
        new.append(token)
        if eos_id is not None:
            finished |= token == eos_id
        if finished.all() or len(new) == max_new_tokens:
            break
        logits = target.extend(token[:, None]).logits[:, -1]

    tokens = torch.stack(new, dim=1)
    lengths = torch.full((B,), tokens.shape[1], dtype=torch.long)
    if eos_id is not None:
        is_eos = tokens == eos_id
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, lengths)
        lengths = first
    return Generation(tokens, lengths)
