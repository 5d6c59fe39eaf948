"""A DFlash drafter's parameters and draft KV cache, from its `DFlashConfig`.

The drafter is a Qwen3-style decoder of ``num_hidden_layers`` layers (RMSNorm, attention with per-head
q/k RMSNorm, RMSNorm, SwiGLU MLP). The target's hidden states, tapped at ``num_taps`` layers and
concatenated, enter once through ``fc`` (``num_taps * target_hidden_size -> hidden_size``, no bias) and
``hidden_norm``; a final ``norm`` precedes the output head. A published HF-native ``config.json`` becomes
a `DFlashConfig` through `minispec.dflash.config.config_from_hf_dflash`, the reader the drafter loader uses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from minispec.costs.units import BF16_BYTES, check_positive, check_positive_int
from minispec.dflash.config import SLIDING, DFlashConfig, config_from_hf_dflash

# Nemotron 3.5 Bolt E4B's DFlash drafter, its published config.json trimmed to what sizes it: 5 Qwen3-style
# layers, hidden 2560, 32 q / 8 kv heads of 128, MLP 5120, taps of 5 of the 42 layers of the 2560-wide
# Gemma-4 target into fc, vocab 262,144, its own output head (the weights hold lm_head.weight), the
# target's embedding, every layer sliding with a 1024-token window, block size 8.
E4B_DFLASH_CONFIG_JSON = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "block_size": 8,
    "dflash_config": {"mask_token_id": 4, "target_layer_ids": [5, 11, 17, 23, 35], "use_swa": True,
                      "swa_window_size": 1024, "causal": False},
    "hidden_size": 2560,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 5120,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "vocab_size": 262144,
    "max_position_embeddings": 131072,
    "rope_theta": 1e6,
    "num_target_layers": 42,
    "layer_types": ["sliding_attention"] * 5,
    "sliding_window": 1024,
    "tie_word_embeddings": False,
}
E4B_DFLASH = config_from_hf_dflash(E4B_DFLASH_CONFIG_JSON, has_lm_head=True)


@dataclass(frozen=True)
class DFlashParamCount:
    """Parameter count of a DFlash drafter, part by part (weights and RMSNorm gains; no buffers).

    The ``*_per_layer`` fields are for one decoder layer; ``layers`` multiplies them out.
    """

    embed_tokens: int
    fc: int
    hidden_norm: int
    attention_per_layer: int
    mlp_per_layer: int
    layer_norms_per_layer: int
    num_layers: int
    norm: int
    lm_head: int

    @property
    def per_layer(self) -> int:
        return self.attention_per_layer + self.mlp_per_layer + self.layer_norms_per_layer

    @property
    def layers(self) -> int:
        return self.num_layers * self.per_layer

    @property
    def total(self) -> int:
        return self.embed_tokens + self.fc + self.hidden_norm + self.layers + self.norm + self.lm_head

    def fraction(self, part: str) -> float:
        """Share of the total held by one part, e.g. ``fraction("lm_head")``."""
        names = {f.name for f in fields(self)} | {"layers", "per_layer"}
        if part not in names or part == "num_layers":
            raise ValueError(f"unknown part {part!r}; choose from {sorted(names - {'num_layers'})}")
        return getattr(self, part) / self.total

    def as_dict(self) -> dict[str, int]:
        """Whole-model parts (layers summed) plus the total, in forward order."""
        return {
            "embed_tokens": self.embed_tokens,
            "fc": self.fc,
            "hidden_norm": self.hidden_norm,
            "attention": self.num_layers * self.attention_per_layer,
            "mlp": self.num_layers * self.mlp_per_layer,
            "layer_norms": self.num_layers * self.layer_norms_per_layer,
            "norm": self.norm,
            "lm_head": self.lm_head,
            "total": self.total,
        }


def dflash_param_count(config: DFlashConfig, has_embed_tokens: bool = False) -> DFlashParamCount:
    """Count a DFlash drafter's parameters from its config.

    ``has_embed_tokens``: whether the drafter stores its own token embedding (no z-lab or minispec drafter
    does: they share the target's; the E4B write-up weighs what a copy would cost).

    With H = hidden, T = target hidden, n = taps, h_q / h_kv = q / kv heads, d = head_dim,
    I = intermediate, V = vocab:

    * ``fc``: n·T·H (no bias); ``hidden_norm``: H; final ``norm``: H.
    * attention per layer: q_proj H·h_q·d + k_proj, v_proj H·h_kv·d each + o_proj h_q·d·H,
      plus ``q_norm`` and ``k_norm`` of d each (one gain vector shared by all heads);
      with ``attention_bias`` also h_q·d + 2·h_kv·d + H biases (Qwen3 puts one on all four).
    * MLP per layer (SwiGLU: gate, up, down): 3·H·I.
    * norms per layer: ``input_layernorm`` + ``post_attention_layernorm`` = 2·H.
    * ``lm_head``: V_d·H if the drafter owns one (V_d = ``draft_vocab_size``, V when None);
      ``embed_tokens``: V·H if stored.

    Bolt E4B: 5·65,541,376 (layers) + 32,768,000 (fc) + 2·2560 + 671,088,640 (head)
    = 1,031,568,640, of which the head is 65.1 %.
    """
    if not isinstance(config, DFlashConfig):
        raise ValueError(f"expected a DFlashConfig, got {type(config).__name__}")
    H, d = config.hidden_size, config.head_dim
    q_width = config.num_attention_heads * d
    kv_width = config.num_key_value_heads * d

    attention = H * q_width + 2 * H * kv_width + q_width * H + 2 * d
    if config.attention_bias:
        attention += q_width + 2 * kv_width + H
    mlp = 3 * H * config.intermediate_size
    head_rows = config.draft_vocab_size or config.vocab_size

    return DFlashParamCount(
        embed_tokens=config.vocab_size * H if has_embed_tokens else 0,
        fc=config.num_taps * config.target_hidden_size * H,
        hidden_norm=H,
        attention_per_layer=attention,
        mlp_per_layer=mlp,
        layer_norms_per_layer=2 * H,
        num_layers=config.num_hidden_layers,
        norm=H,
        lm_head=head_rows * H if config.has_own_lm_head else 0,
    )


def dflash_kv_cache_bytes(
    config: DFlashConfig,
    context_len: int | None = None,
    *,
    num_sequences: int = 1,
    bytes_per_element: float = BF16_BYTES,
) -> float:
    """Bytes of draft KV cache (z-lab/dflash ``dflash/model.py``; vLLM's ``precompute_and_store_context_kv``).

    The draft cache holds only the *context* K and V (projected target features of committed
    tokens); the block's own K/V are dropped after every draft. Per layer and sequence:
    2 (K, V) · h_kv · d · L_cached · bytes, where L_cached = min(context_len, window) on a
    sliding layer and context_len on a full-attention layer.

    ``context_len=None`` asks for the steady state of a long sequence; that is only finite when
    every layer is sliding, and then L_cached = window.

    Bolt E4B: 5 layers · 8 kv heads · 1024 · 128 · 2 (K, V) · 2 bytes = 20,971,520 B = 20 MiB
    per sequence; 64 sequences: 1.25 GiB.
    """
    if not isinstance(config, DFlashConfig):
        raise ValueError(f"expected a DFlashConfig, got {type(config).__name__}")
    check_positive_int(num_sequences=num_sequences)
    check_positive(bytes_per_element=bytes_per_element)
    if context_len is not None:
        check_positive_int(context_len=context_len)

    total_positions = 0
    for i, kind in enumerate(config.layer_types):
        if kind == SLIDING:
            cached = config.sliding_window if context_len is None else min(context_len, config.sliding_window)
        elif context_len is None:
            raise ValueError(
                f"layer {i} is full attention: its cache grows with the sequence; give context_len"
            )
        else:
            cached = context_len
        total_positions += cached
    per_position = 2 * config.num_key_value_heads * config.head_dim * bytes_per_element
    return num_sequences * total_positions * per_position
