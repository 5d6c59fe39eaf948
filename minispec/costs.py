"""Cost model, parameter and memory arithmetic: the published figures, worked out in code.

Read this module like a paper's appendix. Every number the project quotes about Bolt E4B's DFlash
drafter ("Nemotron 3.5 Bolt E4B: block-parallel speculation with DFlash"), NVFP4 checkpoints ("NVFP4
quantization and QAD of Nemotron 3.5 Lightning"; "Nemotron 3.5 Super and Lightning: Open, Efficient
Mixture-of-Experts Hybrid Mamba-Transformer Models for Agentic AI") or Mamba state comes out of one
short function here, and ``tests/test_costs.py`` checks each against the figure as published.

Units, exactly as the sources use them:

* ``MiB`` = 2**20 bytes and ``GiB`` = 2**30 bytes: memory payloads (KV cache, codes, states).
* ``GB`` = 10**9 bytes: checkpoint sizes on disk, as model cards and blogs quote them.

Contents:

1. Units.
2. DFlash drafter shapes (``DFlashShape``, ``E4B_DFLASH``, ``DFlashShape.from_hf_config``),
   parameter breakdown (``dflash_param_count``) and draft KV cache (``dflash_kv_cache_bytes``).
3. Weight payloads: ideal 4-bit codes, NVFP4 bits per parameter, a BF16 embedding copy.
4. Checkpoint sizes under NVFP4 with BF16 exceptions (Lightning, Super, Ultra).
5. The speedup model of speculative decoding and its break-even point.
6. Mamba-2 state and replay-record sizes (Nemotron 3 Super shapes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from minispec.dflash.config import FULL, SLIDING, default_layer_types, read_hf_config

# ---------------------------------------------------------------------------------------------
# 1. Units
# ---------------------------------------------------------------------------------------------

MiB = 2**20
GiB = 2**30
GB = 10**9

BF16_BYTES = 2  # bytes per BF16 (or FP16) element
BF16_BITS = 16


def to_mib(n_bytes: float) -> float:
    """Bytes -> MiB (2**20 bytes)."""
    return n_bytes / MiB


def to_gib(n_bytes: float) -> float:
    """Bytes -> GiB (2**30 bytes)."""
    return n_bytes / GiB


def to_gb(n_bytes: float) -> float:
    """Bytes -> GB (10**9 bytes), the unit of checkpoint sizes on model cards."""
    return n_bytes / GB


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")


def _check_nonnegative(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value!r}")


def _check_positive_int(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_fraction(**values: float) -> None:
    for name, value in values.items():
        _check_nonnegative(**{name: value})
        if value > 1:
            raise ValueError(f"{name} is a fraction and must lie in [0, 1], got {value!r}")


# ---------------------------------------------------------------------------------------------
# 2. DFlash drafter: shape, parameters, draft KV cache
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DFlashShape:
    """The dimensions of a DFlash drafter (z-lab/dflash ``dflash/model.py``; its HF-native ``config.json``).

    The drafter is a Qwen3-style decoder of ``num_layers`` layers (RMSNorm, attention with
    per-head q/k RMSNorm, RMSNorm, SwiGLU MLP). The target's hidden states, tapped at
    ``num_taps`` layers and concatenated, enter once through ``fc`` (``num_taps *
    target_hidden_size -> hidden_size``, no bias) and ``hidden_norm``; a final ``norm`` precedes
    the output head.

    ``has_lm_head`` / ``has_embed_tokens``: whether the drafter stores its own output head /
    token embedding. The original z-lab drafters store neither and share the target's.

    ``sliding_window`` and ``layer_types``: with ``layer_types=None`` every layer is a sliding
    layer when ``sliding_window`` is set, and a full-attention layer otherwise (as in ``DFlashConfig``).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_taps: int
    target_hidden_size: int
    vocab_size: int
    has_lm_head: bool = False
    has_embed_tokens: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attention_bias: bool = False
    block_size: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            num_taps=self.num_taps,
            target_hidden_size=self.target_hidden_size,
            vocab_size=self.vocab_size,
        )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"grouped-query attention needs num_attention_heads ({self.num_attention_heads}) "
                f"to be a multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window is not None:
            _check_positive_int(sliding_window=self.sliding_window)
        if self.block_size is not None:
            _check_positive_int(block_size=self.block_size)
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
            if unknown:
                raise ValueError(f"unknown layer types {unknown}; expected {SLIDING!r} or {FULL!r}")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding layers but sliding_window is not set")

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        """One entry per layer: ``"sliding_attention"`` or ``"full_attention"``."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(default_layer_types(self.num_layers, self.sliding_window))

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any],
        *,
        has_lm_head: bool | None = None,
        has_embed_tokens: bool | None = None,
    ) -> DFlashShape:
        """Read a drafter ``config.json`` in the HF-native (z-lab) format, resolved as vLLM resolves it.

        ``minispec.dflash.config.read_hf_config`` decides each layer's attention type and window and
        the taps (the loader of ``minispec.dflash.export`` reads the file through it too). Then:

        * ``fc`` input width: ``num_taps * (target_hidden_size or hidden_size)``; a file without
          taps gets one per draft layer, as vLLM sizes ``fc`` then
          (``qwen3_dflash._get_dflash_fc_input_size``).
        * Own head / embedding: the keyword arguments win (pass what the safetensors header
          holds: ``lm_head.weight``, ``embed_tokens.weight``); else the keys
          ``has_own_lm_head`` / ``has_lm_head`` and ``has_embed_tokens``; else ``False``, the
          z-lab default of sharing the target's.
        """
        hf = read_hf_config(config)
        if has_lm_head is None:
            has_lm_head = bool(hf.has_own_lm_head)
        if has_embed_tokens is None:
            has_embed_tokens = bool(hf.has_embed_tokens)
        return cls(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=hf.head_dim,
            intermediate_size=hf.intermediate_size,
            num_taps=hf.num_hidden_layers if hf.target_layer_ids is None else len(hf.target_layer_ids),
            target_hidden_size=hf.target_hidden_size,
            vocab_size=hf.vocab_size,
            has_lm_head=has_lm_head,
            has_embed_tokens=has_embed_tokens,
            sliding_window=hf.sliding_window,
            layer_types=hf.layer_types,
            attention_bias=hf.attention_bias,
            block_size=hf.block_size,
        )


# Nemotron 3.5 Bolt E4B's DFlash drafter, as its published config.json gives it: 5 Qwen3-style
# layers, hidden 2560, 32 q / 8 kv heads of 128, MLP 5120, 5 taps of the 2560-wide Gemma-4 target
# into fc, vocab 262,144, its own output head, the target's embedding, every layer sliding with a
# 1024-token window, block size 8.
E4B_DFLASH = DFlashShape(
    num_layers=5,
    hidden_size=2560,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=5120,
    num_taps=5,
    target_hidden_size=2560,
    vocab_size=262_144,
    has_lm_head=True,
    has_embed_tokens=False,
    sliding_window=1024,
    layer_types=(SLIDING,) * 5,
    block_size=8,
)


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


def dflash_param_count(shape: DFlashShape) -> DFlashParamCount:
    """Count a DFlash drafter's parameters from its shape.

    With H = hidden, T = target hidden, n = taps, h_q / h_kv = q / kv heads, d = head_dim,
    I = intermediate, V = vocab:

    * ``fc``: n·T·H (no bias); ``hidden_norm``: H; final ``norm``: H.
    * attention per layer: q_proj H·h_q·d + k_proj, v_proj H·h_kv·d each + o_proj h_q·d·H,
      plus ``q_norm`` and ``k_norm`` of d each (one gain vector shared by all heads);
      with ``attention_bias`` also h_q·d + 2·h_kv·d + H biases (Qwen3 puts one on all four).
    * MLP per layer (SwiGLU: gate, up, down): 3·H·I.
    * norms per layer: ``input_layernorm`` + ``post_attention_layernorm`` = 2·H.
    * ``lm_head``: V·H if the drafter owns one; ``embed_tokens``: V·H if stored.

    Bolt E4B: 5·65,541,376 (layers) + 32,768,000 (fc) + 2·2560 + 671,088,640 (head)
    = 1,031,568,640, of which the head is 65.1 %.
    """
    if not isinstance(shape, DFlashShape):
        raise ValueError(f"expected a DFlashShape, got {type(shape).__name__}")
    H, d = shape.hidden_size, shape.head_dim
    q_width = shape.num_attention_heads * d
    kv_width = shape.num_key_value_heads * d

    attention = H * q_width + 2 * H * kv_width + q_width * H + 2 * d
    if shape.attention_bias:
        attention += q_width + 2 * kv_width + H
    mlp = 3 * H * shape.intermediate_size
    vocab_matrix = shape.vocab_size * H

    return DFlashParamCount(
        embed_tokens=vocab_matrix if shape.has_embed_tokens else 0,
        fc=shape.num_taps * shape.target_hidden_size * H,
        hidden_norm=H,
        attention_per_layer=attention,
        mlp_per_layer=mlp,
        layer_norms_per_layer=2 * H,
        num_layers=shape.num_layers,
        norm=H,
        lm_head=vocab_matrix if shape.has_lm_head else 0,
    )


def dflash_kv_cache_bytes(
    shape: DFlashShape,
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
    if not isinstance(shape, DFlashShape):
        raise ValueError(f"expected a DFlashShape, got {type(shape).__name__}")
    _check_positive_int(num_sequences=num_sequences)
    _check_positive(bytes_per_element=bytes_per_element)
    if context_len is not None:
        _check_positive_int(context_len=context_len)

    total_positions = 0
    for i, kind in enumerate(shape.resolved_layer_types):
        if kind == SLIDING:
            assert shape.sliding_window is not None
            cached = shape.sliding_window if context_len is None else min(context_len, shape.sliding_window)
        elif context_len is None:
            raise ValueError(
                f"layer {i} is full attention: its cache grows with the sequence; give context_len"
            )
        else:
            cached = context_len
        total_positions += cached
    per_position = 2 * shape.num_key_value_heads * shape.head_dim * bytes_per_element
    return num_sequences * total_positions * per_position


# ---------------------------------------------------------------------------------------------
# 3. Weight payloads
# ---------------------------------------------------------------------------------------------


def nvfp4_bits_per_param(block_size: int = 16, *, code_bits: int = 4, scale_bits: int = 8) -> float:
    """Storage bits per NVFP4 element (the two-level NVFP4 format of NVIDIA Model Optimizer).

    A 4-bit E2M1 code per element plus one 8-bit E4M3 scale per block of 16:
    4 + 8/16 = 4.5 bits (ModelOpt's ``effective_bits: 4.5``). The FP32 per-tensor scale adds
    32 bits per *tensor*, i.e. nothing measurable per parameter, so it is left out.
    """
    _check_positive_int(block_size=block_size, code_bits=code_bits, scale_bits=scale_bits)
    return code_bits + scale_bits / block_size


def ideal_4bit_code_bytes(n_params: int) -> float:
    """Bytes of bare 4-bit codes: n_params · 4 bits / 8, with no block scales.

    The floor any 4-bit format approaches. Bolt E4B's drafter: 1,031,568,640 / 2 = 515,784,320 B
    = 491.9 MiB; its head alone 671,088,640 / 2 B = 320 MiB.
    """
    _check_nonnegative(n_params=n_params)
    return n_params * 4 / 8


def nvfp4_bytes(n_params: int, block_size: int = 16) -> float:
    """Bytes of NVFP4 codes plus their E4M3 block scales: n_params · 4.5 bits / 8."""
    _check_nonnegative(n_params=n_params)
    return n_params * nvfp4_bits_per_param(block_size) / 8


def embedding_bytes(vocab_size: int, hidden_size: int, bytes_per_element: float = BF16_BYTES) -> float:
    """Bytes of one vocab × hidden matrix (an embedding table or an output head).

    A BF16 copy of Bolt E4B's 262,144 × 2560 embedding: 262,144 · 2560 · 2 B
    = 1,342,177,280 B = 1.25 GiB, which is what a drafter saves by sharing the target's.
    """
    _check_positive_int(vocab_size=vocab_size, hidden_size=hidden_size)
    _check_positive(bytes_per_element=bytes_per_element)
    return vocab_size * hidden_size * bytes_per_element


# ---------------------------------------------------------------------------------------------
# 4. Checkpoint sizes: NVFP4 with BF16 exceptions
# ---------------------------------------------------------------------------------------------
#
# A quantized checkpoint keeps some modules in BF16 (embeddings, attention, norms, routers, MTP: the
# Nemotron recipes in Model Optimizer's modelopt_recipes). With a fraction f of the parameters in BF16
# and the rest NVFP4:
#
#     bits per parameter  b = 16·f + 4.5·(1 − f)
#     quantized size      S_q = S_bf16 · b / 16
#
# Nemotron-3.5-Lightning ("NVFP4 quantization and QAD of Nemotron 3.5 Lightning"): 66 GB in BF16.
# All-NVFP4 would be 66 · 4.5/16 = 18.56 GB; the quoted ~22 GB needs
# f = (22/66 − 4.5/16) / (1 − 4.5/16) = 7.2 % of the parameters in BF16, about 2.4 B of its 33 B.
# Model Optimizer's Lightning recipe (ptq/w4a16_nvfp4_4o6.yaml) names the modules (attention
# projections, embeddings, routers, norms, conv1d and the MTP subtree in BF16, Mamba in/out_proj in
# FP8) but not the split by parameter count, so f is solved for, not reproduced.


def mixed_bits_per_param(bf16_fraction: float, quant_bits: float | None = None) -> float:
    """Average bits per parameter with ``bf16_fraction`` kept in BF16: 16·f + b_q·(1 − f).

    ``quant_bits`` defaults to NVFP4's 4.5.
    """
    _check_fraction(bf16_fraction=bf16_fraction)
    quant_bits = nvfp4_bits_per_param() if quant_bits is None else quant_bits
    _check_positive(quant_bits=quant_bits)
    return BF16_BITS * bf16_fraction + quant_bits * (1 - bf16_fraction)


def quantized_checkpoint_gb(bf16_gb: float, bf16_fraction: float, quant_bits: float | None = None) -> float:
    """GB of a checkpoint after quantizing a ``bf16_gb`` BF16 checkpoint, keeping a fraction in BF16.

    S_q = S_bf16 · (16·f + 4.5·(1 − f)) / 16. Lightning: 66 GB, f = 7.2 % -> 22.0 GB.
    """
    _check_positive(bf16_gb=bf16_gb)
    return bf16_gb * mixed_bits_per_param(bf16_fraction, quant_bits) / BF16_BITS


def bf16_fraction_for(bf16_gb: float, quantized_gb: float, quant_bits: float | None = None) -> float:
    """Fraction of parameters kept in BF16 that turns ``bf16_gb`` into ``quantized_gb``.

    Solve S_q / S_bf16 = (16·f + b_q·(1 − f)) / 16 for f:  f = (16·S_q/S_bf16 − b_q) / (16 − b_q).
    Lightning: (16·22/66 − 4.5) / 11.5 = 0.0725.
    """
    _check_positive(bf16_gb=bf16_gb, quantized_gb=quantized_gb)
    quant_bits = nvfp4_bits_per_param() if quant_bits is None else quant_bits
    _check_positive(quant_bits=quant_bits)
    if not quant_bits < BF16_BITS:
        raise ValueError(f"quant_bits ({quant_bits}) must be below 16 to shrink a BF16 checkpoint")
    bits = BF16_BITS * quantized_gb / bf16_gb
    if not quant_bits <= bits <= BF16_BITS:
        raise ValueError(
            f"{quantized_gb} GB from {bf16_gb} GB is {bits:.2f} bits/param, outside "
            f"[{quant_bits}, 16]: no BF16 fraction explains it"
        )
    return bf16_fraction_for_bits(bits, quant_bits)


def bf16_fraction_for_bits(bits_per_param: float, quant_bits: float | None = None) -> float:
    """BF16 fraction that gives an average of ``bits_per_param``: f = (b − b_q) / (16 − b_q).

    Super's 4.82 bits/param over NVFP4's 4.5: f = 0.32 / 11.5 = 2.8 %.
    """
    quant_bits = nvfp4_bits_per_param() if quant_bits is None else quant_bits
    _check_positive(bits_per_param=bits_per_param, quant_bits=quant_bits)
    if not quant_bits <= bits_per_param <= BF16_BITS or quant_bits >= BF16_BITS:
        raise ValueError(f"bits_per_param must lie in [{quant_bits}, 16], got {bits_per_param}")
    return (bits_per_param - quant_bits) / (BF16_BITS - quant_bits)


def params_from_size(size_bytes: float, bits_per_param: float) -> float:
    """Parameter count implied by a weight payload: N = bytes · 8 / bits per parameter.

    Nemotron 3 Super: ~75 GB of weights at 4.82 bits/param -> 75e9 · 8 / 4.82 = 124 B parameters,
    consistent with its nominal 120 B (the remainder: MTP head and rounding of "~75 GB").
    Pass GB as ``75 * GB``: the sources quote checkpoint sizes in GB (10**9 bytes).
    """
    _check_positive(size_bytes=size_bytes, bits_per_param=bits_per_param)
    return size_bytes * 8 / bits_per_param


# ---------------------------------------------------------------------------------------------
# 5. The speedup model
# ---------------------------------------------------------------------------------------------
#
# One speculative cycle drafts, then verifies in one target forward, and emits tau tokens
# (accepted drafts + 1, as the papers count it, so tau >= 1). Plain decoding emits one token per
# target forward of cost C_t. Hence the speedup formula of the Bolt E4B write-up
#
#     speedup = tau · C_t / (C_d + C_v)
#
# with C_d the cost of drafting one cycle (all draft passes) and C_v the cost of the verify
# forward. Costs are in any one unit (ms, FLOPs, bytes moved); only ratios matter. Speculation
# pays when speedup > 1, i.e. when tau exceeds the break-even tau* = (C_d + C_v) / C_t.


def _check_tau(tau: float) -> None:
    _check_positive(tau=tau)
    if tau < 1:
        raise ValueError(f"tau counts accepted drafts + 1 per target forward, so tau >= 1; got {tau}")


def speedup(tau: float, c_target: float, c_draft: float, c_verify: float) -> float:
    """Speculative speedup over plain decoding: tau · C_t / (C_d + C_v).

    ``c_draft`` may be 0 (prompt lookup drafts for free); ``c_target`` and ``c_verify`` must be
    positive. With free drafts and a verify as cheap as one decode step, speedup = tau.
    """
    _check_tau(tau)
    _check_positive(c_target=c_target, c_verify=c_verify)
    _check_nonnegative(c_draft=c_draft)
    return tau * c_target / (c_draft + c_verify)


def break_even_tau(c_target: float, c_draft: float, c_verify: float) -> float:
    """The tau at which speculation neither helps nor hurts: tau* = (C_d + C_v) / C_t.

    May be below 1 in an idealized model (free drafts, verify cheaper than a decode step); any
    real tau >= 1 then wins.
    """
    _check_positive(c_target=c_target, c_verify=c_verify)
    _check_nonnegative(c_draft=c_draft)
    return (c_draft + c_verify) / c_target


def implied_cycle_cost(tau: float, measured_speedup: float) -> float:
    """(C_d + C_v) / C_t implied by a measured speedup at a measured tau: tau / speedup.

    The cost of one speculative cycle in units of one plain decode step. z-lab's first README
    (z-lab/dflash at commit bb48ef9), Qwen3-8B on GSM8K at T=0: DFlash 6.55 / 5.20x = 1.26 decode steps
    per cycle (one parallel draft pass); EAGLE-3 2.89 / 2.13x = 1.36 (seven sequential passes).
    """
    _check_tau(tau)
    _check_positive(measured_speedup=measured_speedup)
    return tau / measured_speedup


# ---------------------------------------------------------------------------------------------
# 6. Mamba-2 state and the bytes of checkpoint + replay
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mamba2Shape:
    """Shapes of a Mamba-2 mixer: H heads of dim P, state size N, G groups of B/C."""

    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    num_layers: int = 1

    def __post_init__(self) -> None:
        _check_positive_int(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            d_state=self.d_state,
            n_groups=self.n_groups,
            num_layers=self.num_layers,
        )
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")


# Nemotron 3 Super 120B: H=128, P=64, N=128, G=8; 40 Mamba layers of 88 (its config.json; transformers'
# NemotronHConfig has the same defaults).
SUPER_MAMBA2 = Mamba2Shape(num_heads=128, head_dim=64, d_state=128, n_groups=8, num_layers=40)


def mamba_state_bytes(shape: Mamba2Shape, bytes_per_element: float = 4) -> float:
    """SSM state of one layer and sequence: H · P · N · bytes (fp32 by default).

    Super: 128 · 64 · 128 · 4 B = 4 MiB per layer (the conv state is separate and not counted).
    """
    _check_positive(bytes_per_element=bytes_per_element)
    return shape.num_heads * shape.head_dim * shape.d_state * bytes_per_element


def replay_record_bytes(shape: Mamba2Shape, x_bytes: float = BF16_BYTES, dt_bytes: float = 4) -> float:
    """One checkpoint + replay record per token and layer: x (H·P) and B (G·N) in bf16, dt (H) in fp32
    (the record of ReplaySSM, Dao AI Lab: Johnny-Liou/ReplaySSM).

    Super: (8192 + 1024) · 2 + 128 · 4 = 18,944 B, 0.45 % of the 4 MiB state: replaying from a
    checkpoint stores a record per draft position instead of a whole state.
    """
    _check_positive(x_bytes=x_bytes, dt_bytes=dt_bytes)
    x_and_b = shape.num_heads * shape.head_dim + shape.n_groups * shape.d_state
    return x_and_b * x_bytes + shape.num_heads * dt_bytes


def native_spec_state_writes_bytes(
    shape: Mamba2Shape, num_tokens: int, bytes_per_element: float = 4
) -> float:
    """State traffic of one verify step when every position's state is written (vLLM native).

    Reads the state once and writes it T times: (1 + T) · S per layer. Super, T = 4: 20 MiB;
    plain decode (T = 1) moves 8 MiB per token.
    """
    _check_positive_int(num_tokens=num_tokens)
    return (1 + num_tokens) * mamba_state_bytes(shape, bytes_per_element)


# lightning-mini (minispec's Nemotron-H hybrid): H=8, P=32, N=32, G=2; 4 Mamba layers of 8.
LIGHTNING_MINI_MAMBA2 = Mamba2Shape(num_heads=8, head_dim=32, d_state=32, n_groups=2, num_layers=4)


@dataclass(frozen=True)
class SpecStateTraffic:
    """Mamba state bytes per layer and sequence for one strategy, averaged over verify steps."""

    strategy: str
    window: int  # T = drafts + 1
    committed_per_step: int  # accepted drafts + the bonus/correction token
    read_per_step: float
    written_per_step: float
    memory_per_request: float  # state + ring (replay) or T states (per-position), conv windows included

    @property
    def written_per_token(self) -> float:
        return self.written_per_step / self.committed_per_step

    @property
    def read_per_token(self) -> float:
        return self.read_per_step / self.committed_per_step


def spec_state_traffic(shape: Mamba2Shape, window: int, committed_per_step: int, strategy: str,
                       capacity: int = 16, conv_kernel: int = 4, state_bytes: float = 4, act_bytes: float = BF16_BYTES,
                       steps: int = 1000) -> SpecStateTraffic:
    """The byte model `minispec.ssm.replay`'s stores count, for any shape.

    State = SSM state (H·P·N · state_bytes) + conv window ((K-1) · conv_dim · act_bytes),
    conv_dim = H·P + 2·G·N. A record = x (H·P), B (G·N), dt (H, state_bytes), and the pre-conv column
    (conv_dim) that rebuilds the conv window on rollback.
      per-position: each verify step reads 1 state and writes T.
      replay:       each verify step reads the checkpoint, the committed records (x, B, dt) and the conv
                    window, and writes T records; when count + T > capacity the committed records are
                    first folded (flush: read checkpoint + records, write the checkpoint once).
    Every step keeps `committed_per_step` tokens; averaged over `steps` steps from an empty ring.
    """
    _check_positive_int(window=window, committed_per_step=committed_per_step, capacity=capacity, steps=steps)
    if committed_per_step > window:
        raise ValueError(f"committed_per_step ({committed_per_step}) cannot exceed the window T ({window})")
    if strategy not in ("per-position", "replay"):
        raise ValueError(f"strategy must be 'per-position' or 'replay', got {strategy!r}")
    if strategy == "replay" and window > capacity:
        raise ValueError(f"a window of {window} tokens does not fit a ring of {capacity} records")
    ssm = mamba_state_bytes(shape, state_bytes)
    conv_dim = shape.num_heads * shape.head_dim + 2 * shape.n_groups * shape.d_state
    conv = (conv_kernel - 1) * conv_dim * act_bytes
    replay_part = ((shape.num_heads * shape.head_dim + shape.n_groups * shape.d_state) * act_bytes
                   + shape.num_heads * state_bytes)
    record = replay_part + conv_dim * act_bytes
    if strategy == "per-position":
        return SpecStateTraffic(strategy, window, committed_per_step, ssm + conv, window * (ssm + conv),
                                window * (ssm + conv))
    read = written = 0.0
    count = 0
    for _ in range(steps):
        if count + window > capacity:
            read += ssm + count * replay_part
            written += ssm
            count = 0
        read += ssm + count * replay_part + conv
        written += window * record
        count += committed_per_step
    return SpecStateTraffic(strategy, window, committed_per_step, read / steps, written / steps,
                            ssm + conv + capacity * record)
