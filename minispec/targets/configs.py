"""Configurations of the target models minispec trains and ships.

bolt-mini mirrors Nemotron 3.5 Bolt E4B's attention layout at toy scale: a Gemma-4 text model
whose layers run five sliding-window layers, then one full-attention layer, repeated. Its
full-attention layers (5 and 11) are the ones a DFlash drafter taps, as E4B's drafter taps the
global layers of its target.
"""
from __future__ import annotations

from transformers import Gemma4TextConfig

from minispec.targets.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE


def bolt_mini_config(num_hidden_layers: int = 12) -> Gemma4TextConfig:
    return Gemma4TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=192,
        intermediate_size=576,
        num_hidden_layers=num_hidden_layers,  # layer_types default to E4B's 5 sliding : 1 full pattern
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        global_head_dim=64,
        sliding_window=128,
        max_position_embeddings=4096,
        final_logit_softcapping=30.0,
        # Gemma-4's per-layer input embeddings (PLE) are off: E4B's drafter story does not need them.
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB_SIZE,
        tie_word_embeddings=True,
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        eos_token_id=SPECIAL_TOKENS.index("<eos>"),
        bos_token_id=SPECIAL_TOKENS.index("<bos>"),
        attn_implementation="sdpa",
    )


def bolt_nano_config() -> Gemma4TextConfig:
    """The classic draft model for bolt-mini: the same architecture cut to 2 layers (one sliding, one
    full), with its own embedding and head. About a fifth of bolt-mini's compute per token."""
    return bolt_mini_config(num_hidden_layers=2)


CONFIGS = {"bolt-mini": bolt_mini_config, "bolt-nano": bolt_nano_config}
