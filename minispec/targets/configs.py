"""Configurations of the target models minispec trains and ships.

bolt-mini mirrors Nemotron 3.5 Bolt E4B's attention layout at toy scale: a Gemma-4 text model
whose layers run five sliding-window layers, then one full-attention layer, repeated. Its
full-attention layers are 5 and 11; its DFlash drafter taps layers 5, 8 and 10 (this project's choice: 11 is the
last layer and cannot be tapped), while E4B's drafter taps five of its target's seven full-attention layers.
"""
from __future__ import annotations

import math

from transformers import Gemma4TextConfig, NemotronHConfig

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


# Nemotron-H letters: M = Mamba-2, E = mixture-of-experts MLP, * = attention, - = dense MLP.
LIGHTNING_MINI_PATTERN = "MEM*M-ME"


def lightning_mini_config() -> NemotronHConfig:
    """lightning-mini: Nemotron-H's hybrid layout at toy scale, the Mamba replay target.

    Like Nemotron 3, most token mixing is Mamba-2 (4 of 8 layers), one attention layer (no positional
    encoding: Nemotron-H attention has no RoPE, the Mamba layers carry position), and the channel
    mixing is dense relu^2 MLPs and routed MoE MLPs (4 experts, top-2 by sigmoid score, plus one shared
    expert). Mamba: H=8 heads of P=32, state N=32, G=2 groups, conv K=4. Untied embedding and head,
    as in Nemotron-H.
    """
    return NemotronHConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        hybrid_override_pattern=LIGHTNING_MINI_PATTERN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=32,
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
        # dt >= time_step_min in every path: the clamp lightning-mini was trained with (what transformers
        # applied in its chunked path before 5.25). From 5.25 on transformers applies this field, in both paths.
        time_step_limit=(1e-3, math.inf),
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=256,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        eos_token_id=SPECIAL_TOKENS.index("<eos>"),
        bos_token_id=SPECIAL_TOKENS.index("<bos>"),
        attn_implementation="sdpa",
    )


CONFIGS = {"bolt-mini": bolt_mini_config, "bolt-nano": bolt_nano_config, "lightning-mini": lightning_mini_config}
