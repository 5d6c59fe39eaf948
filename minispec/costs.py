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
4. Checkpoint sizes under NVFP4 with BF16 exceptions (Lightning, Super, Ultra), and from the tiers
   of each kind of parameter (``NemotronHShape``, ``SUPER_SHAPE``, ``tiered_checkpoint``).
5. The speedup model of speculative decoding and its break-even point.
6. Mamba-2 state and replay-record sizes (Nemotron 3 Super shapes).
7. Serving: accelerators (H200, B200), served-model shapes (E4B target and DFlash drafter, Super), the
   roofline by batch, the break-even batch, memory per request and requests per GPU.
"""

from __future__ import annotations

import functools
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

    A two-tier reading: everything not in BF16 is at ``quant_bits``. For Super's 4.82 bits/param it
    gives f = 0.32 / 11.5 = 2.8 %, which is *not* Super's BF16 share: its recipe has a third, FP8 tier
    (attention and Mamba projections), counted from the shapes by ``tiered_checkpoint`` below.
    """
    quant_bits = nvfp4_bits_per_param() if quant_bits is None else quant_bits
    _check_positive(bits_per_param=bits_per_param, quant_bits=quant_bits)
    if not quant_bits <= bits_per_param <= BF16_BITS or quant_bits >= BF16_BITS:
        raise ValueError(f"bits_per_param must lie in [{quant_bits}, 16], got {bits_per_param}")
    return (bits_per_param - quant_bits) / (BF16_BITS - quant_bits)


def params_from_size(size_bytes: float, bits_per_param: float) -> float:
    """Parameter count implied by a weight payload: N = bytes · 8 / bits per parameter.

    Nemotron 3 Super: ~75 GB of weights at 4.82 bits/param -> 75e9 · 8 / 4.82 = 124 B parameters,
    consistent with its 120.7 B plus its 2.9 B MTP layer (123.6 B, counted by ``nemotron_h_param_groups``).
    Pass GB as ``75 * GB``: the sources quote checkpoint sizes in GB (10**9 bytes).
    """
    _check_positive(size_bytes=size_bytes, bits_per_param=bits_per_param)
    return size_bytes * 8 / bits_per_param


# The same accounting from the tiers, without an unknown. The Super/Lightning paper's recipe ("Nemotron 3.5
# Super and Lightning: Open, Efficient Mixture-of-Experts Hybrid Mamba-Transformer Models for Agentic AI")
# stores each kind of parameter of a Nemotron-H model in one tier:
#
#     NVFP4 (4.5 bits)  the matmuls of the routed and shared experts (and of dense MLP layers)
#     FP8   (8 bits)    attention projections (q, k, v, o) and Mamba in/out projections
#     BF16  (16 bits)   the output head (above NVFP4), the embedding, MoE latent projections, routers,
#                       norms, conv1d and the SSM parameters (A_log, D, dt_bias)
#
# Counting each kind from the published shapes gives bits per parameter and bytes directly. For Nemotron 3
# Super (below) this gives 4.78 bits per parameter and 73.8 GB for its 123.6 B parameters (the MTP layer
# included, with the same tiers), against the paper's 4.82 bits and ~75 GB: 0.9 % fewer bits, 0.67 GB
# (5.4 Gbit) short of 4.82 bits on 123.6 B parameters; the paper does not list its per-kind counts, so where
# those bytes sit is not known. Model Optimizer's map for Super (shared experts FP8, attention BF16) lands
# above it, at 4.85 bits and 74.9 GB. The parameter count itself checks out: 75 GB at 4.82 bits is 124 B
# parameters (`params_from_size`).
# (Two tiers only, "4.82 bits = 2.8 % BF16 and the rest NVFP4", would hide the 4.7 B FP8 parameters.)

NVFP4, FP8, BF16 = "nvfp4", "fp8", "bf16"
TIER_BITS = {NVFP4: nvfp4_bits_per_param(), FP8: 8.0, BF16: float(BF16_BITS)}

# The paper's tiers by kind of parameter (`nemotron_h_param_groups`); every kind not listed is BF16.
SUPER_PAPER_TIERS = {"routed_experts": NVFP4, "shared_experts": NVFP4, "mlp": NVFP4,
                     "attention": FP8, "mamba_projections": FP8}
# Model Optimizer's published PTQ recipe for Nemotron 3 Super (ptq/nvfp4-mse.yaml, the component map of its
# Nemotron 3 Ultra recipe): shared experts FP8, not NVFP4; attention left in BF16, not FP8.
MODELOPT_SUPER_TIERS = {"routed_experts": NVFP4, "shared_experts": FP8, "mamba_projections": FP8}

_BLOCK_KINDS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
                "moe": "E", "mlp": "-"}


@dataclass(frozen=True)
class NemotronHShape:
    """The shapes of a Nemotron-H model: the fields of transformers' ``NemotronHConfig`` that size its weights.

    ``pattern``: one letter per layer (``hybrid_override_pattern``): M Mamba-2, * attention, E MoE (routed
    experts + one shared expert), - dense MLP. ``mtp_pattern``: the layers of each MTP block ("*E" for
    Super), ``num_mtp_layers`` such blocks. ``moe_latent_size``: LatentMoE's width (routed experts work in
    it, between a down- and an up-projection); None when the experts work at ``hidden_size``.
    """

    pattern: str
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    n_routed_experts: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None = None
    intermediate_size: int = 0
    tie_word_embeddings: bool = False
    mtp_pattern: str = ""
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.pattern + self.mtp_pattern) - set("M*E-"))
        if unknown or not self.pattern:
            raise ValueError(f"pattern letters are M, *, E, -; got {self.pattern!r} / {self.mtp_pattern!r}")
        _check_positive_int(hidden_size=self.hidden_size, vocab_size=self.vocab_size)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> NemotronHShape:
        """From a Nemotron-H ``config.json`` (or ``NemotronHConfig.to_dict()``)."""
        def letters(kinds) -> str:
            return "".join(_BLOCK_KINDS[k] for k in kinds)

        pattern = config.get("hybrid_override_pattern") or letters(config["layers_block_type"])
        mtp = config.get("mtp_hybrid_override_pattern") or letters(config.get("mtp_layers_block_type") or [])
        names = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                 "n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size")
        return cls(pattern=pattern, **{n: config[n] for n in names},
                   moe_latent_size=config.get("moe_latent_size"), intermediate_size=config.get("intermediate_size", 0),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), mtp_pattern=mtp,
                   num_mtp_layers=config.get("num_nextn_predict_layers", 0) or 0)


# Nemotron 3 Super 120B-A12B, from its config.json (nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 on the
# Hugging Face Hub): 88 layers, 40 Mamba-2 (128 heads of 64, state 128, 8 groups), 40 LatentMoE (512 routed
# experts of 2688 working at latent width 1024, a shared expert of 5376), 8 attention (32 q / 2 kv heads of
# 128); hidden 4096, vocabulary 131,072, untied head; one MTP block of an attention and a MoE layer. Only the
# counts of each layer kind matter here, so the pattern lists them grouped, not in the model's order.
SUPER_SHAPE = NemotronHShape(
    pattern="M" * 40 + "E" * 40 + "*" * 8,
    hidden_size=4096, vocab_size=131_072, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
    mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
    n_routed_experts=512, moe_intermediate_size=2688, moe_shared_expert_intermediate_size=5376,
    moe_latent_size=1024, mtp_pattern="*E", num_mtp_layers=1,
)


def nemotron_h_param_groups(shape: NemotronHShape) -> dict[str, int]:
    """Parameters of a Nemotron-H model by kind (weights and norm gains; no buffers).

    With H hidden, V vocabulary, d_i = mamba heads · head dim, G·N groups times state, h Mamba heads:
      routed_experts     per MoE layer E · 2 · I · w  (up [I, w] and down [w, I]; w = latent or H)
      shared_experts     per MoE layer 2 · H · I_shared
      mlp                per dense MLP layer 2 · H · I
      attention          per attention layer H · q + 2 · H · kv + q · H  (q = heads · d, kv = kv heads · d)
      mamba_projections  per Mamba layer H · (2 d_i + 2 G·N + h) (in_proj) + d_i · H (out_proj)
      latent_projections per MoE layer 2 · H · latent (LatentMoE only)
      routers            per MoE layer E · H
      mamba_other        per Mamba layer conv1d (d_i + 2 G·N) · (K + 1), A_log, D, dt_bias (h each), gated norm d_i
      norms              one gain of H per layer and the final norm
      embedding, output_head   V · H each (one of them if tied)
      mtp_projections    per MTP block: its [H, 2H] input projection and three norms (Megatron's MTP block);
                         the MTP block's layers count in the kinds above.
    """
    H = shape.hidden_size
    d_inner = shape.mamba_num_heads * shape.mamba_head_dim
    gn = shape.n_groups * shape.ssm_state_size
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    expert_width = shape.moe_latent_size or H
    per_layer = {
        "M": {"mamba_projections": H * (2 * d_inner + 2 * gn + shape.mamba_num_heads) + d_inner * H,
              "mamba_other": (d_inner + 2 * gn) * (shape.conv_kernel + 1) + 3 * shape.mamba_num_heads + d_inner},
        "*": {"attention": H * q + 2 * H * kv + q * H},
        "E": {"routed_experts": shape.n_routed_experts * 2 * shape.moe_intermediate_size * expert_width,
              "shared_experts": 2 * H * shape.moe_shared_expert_intermediate_size,
              "latent_projections": 2 * H * shape.moe_latent_size if shape.moe_latent_size else 0,
              "routers": shape.n_routed_experts * H},
        "-": {"mlp": 2 * H * shape.intermediate_size},
    }
    groups = dict.fromkeys(("routed_experts", "shared_experts", "mlp", "attention", "mamba_projections",
                            "latent_projections", "routers", "mamba_other", "norms", "embedding", "output_head",
                            "mtp_projections"), 0)
    layers = shape.pattern + shape.mtp_pattern * shape.num_mtp_layers
    for letter in layers:
        for kind, n in per_layer[letter].items():
            groups[kind] += n
    groups["norms"] = (len(layers) + 1) * H
    groups["embedding"] = shape.vocab_size * H
    groups["output_head"] = 0 if shape.tie_word_embeddings else shape.vocab_size * H
    groups["mtp_projections"] = shape.num_mtp_layers * (2 * H * H + 3 * H)
    return groups


@dataclass(frozen=True)
class TieredCheckpoint:
    """Parameters per tier, and the checkpoint they make: bits per parameter and bytes."""

    params_by_tier: dict[str, int]

    @property
    def params(self) -> int:
        return sum(self.params_by_tier.values())

    @property
    def bits(self) -> float:
        return sum(n * TIER_BITS[t] for t, n in self.params_by_tier.items())

    @property
    def bits_per_param(self) -> float:
        return self.bits / self.params

    @property
    def total_bytes(self) -> float:
        return self.bits / 8


def tiered_checkpoint(shape: NemotronHShape, tiers: Mapping[str, str] = SUPER_PAPER_TIERS) -> TieredCheckpoint:
    """Put each kind of parameter of `shape` in its tier (`tiers`: kind -> "nvfp4" / "fp8" / "bf16"; kinds
    not named stay BF16) and add up. NVFP4's per-tensor FP32 scales are left out (a few bytes per tensor).

    Nemotron 3 Super with the paper's tiers: 117.37 B NVFP4, 4.70 B FP8, 1.54 B BF16 parameters ->
    4.78 bits per parameter, 73.8 GB; with Model Optimizer's map (MODELOPT_SUPER_TIERS) 4.85 bits, 74.9 GB.
    The paper's 4.82 bits and ~75 GB lie between the two.
    """
    groups = nemotron_h_param_groups(shape)
    unknown = sorted(set(tiers) - set(groups))
    if unknown:
        raise ValueError(f"unknown kinds of parameter {unknown}; kinds are {sorted(groups)}")
    bad = sorted(set(tiers.values()) - set(TIER_BITS))
    if bad:
        raise ValueError(f"unknown tiers {bad}; tiers are {sorted(TIER_BITS)}")
    by_tier = dict.fromkeys(TIER_BITS, 0)
    for kind, n in groups.items():
        by_tier[tiers.get(kind, BF16)] += n
    return TieredCheckpoint(by_tier)


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


# ---------------------------------------------------------------------------------------------
# 7. Serving: batch size, concurrency and memory per request
# ---------------------------------------------------------------------------------------------
#
# Section 5 prices one cycle at batch 1. A server decodes many sequences at once, and one forward then
# moves two kinds of bytes and does one kind of work:
#
#     weights      read ONCE per forward, whatever the batch (all of a dense model; the experts the
#                  batch's tokens route to, for a mixture of experts)
#     KV / state   read per sequence: the KV cache of its context, the Mamba state (read and written)
#     FLOPs        2 · active parameters per token, for every token of every sequence
#
# and takes max(bytes / bandwidth, FLOPs / peak), the roofline. At batch 1 the weights dominate and a
# verify forward over K + 1 tokens costs about as much as a decode step over 1: speculation buys ~tau.
# As the batch grows the forward becomes compute-bound, a verify forward costs up to K + 1 decode steps,
# and the speedup tau · C_t / (C_d + C_v) falls below 1: the Bolt E4B write-up's serving advice follows
# (`max-num-seqs 1` with speculative decoding for latency; a 64-sequence throughput setup without it).
# Attention FLOPs over the context and activations are left out: both grow the per-sequence part, which
# only brings the break-even batch earlier.


@dataclass(frozen=True)
class Accelerator:
    """One GPU as the roofline sees it: memory, memory bandwidth and dense BF16 peak."""

    name: str
    memory_bytes: float
    bandwidth: float  # bytes / s
    flops: float  # dense BF16 FLOP / s

    def __post_init__(self) -> None:
        _check_positive(memory_bytes=self.memory_bytes, bandwidth=self.bandwidth, flops=self.flops)


# NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16 (1,979 with sparsity).
H200 = Accelerator("H200", 141 * GB, 4.8e12, 989e12)
# NVIDIA DGX B200 datasheet: 1,440 GB and 64 TB/s for 8 GPUs, i.e. 180 GB and 8 TB/s each;
# 2.25 PFLOPS dense BF16 per GPU (HGX B200: 36 PFLOPS FP16/BF16 for 8, with sparsity).
B200 = Accelerator("B200", 180 * GB, 8.0e12, 2.25e15)


@dataclass(frozen=True)
class ServedModel:
    """What one forward of a model costs per token and per sequence, and what it keeps per request.

    weight_bytes:          all weights as stored (what must fit in memory)
    active_weight_bytes:   weights one token reads (a dense model reads them once per forward, whatever the
                           number of tokens; embedding tables are looked up, not read whole)
    routed:                a mixture of experts: more tokens in a forward route to more experts (see
                           `weight_bytes_read`)
    flops_per_token:       2 · active parameters
    kv_bytes_per_token:    KV cache per context token and sequence on the layers whose cache grows
                           with the context
    window_kv_bytes_per_token, window: KV per token on sliding-window layers, which keep `window` tokens
    mamba, spec_strategy:  the Mamba-2 layers (None: none) and how a verify window keeps their state,
                           "per-position" (T states) or "replay" (checkpoint + records), as section 6 counts it
    """

    name: str
    weight_bytes: float
    active_weight_bytes: float
    flops_per_token: float
    kv_bytes_per_token: float = 0.0
    window_kv_bytes_per_token: float = 0.0
    window: int = 1
    routed: bool = False
    mamba: Mamba2Shape | None = None
    spec_strategy: str = "per-position"

    def __post_init__(self) -> None:
        _check_positive(weight_bytes=self.weight_bytes, active_weight_bytes=self.active_weight_bytes,
                        flops_per_token=self.flops_per_token)
        _check_nonnegative(kv_bytes_per_token=self.kv_bytes_per_token,
                           window_kv_bytes_per_token=self.window_kv_bytes_per_token)
        if self.spec_strategy not in ("per-position", "replay"):
            raise ValueError(f"spec_strategy must be 'per-position' or 'replay', got {self.spec_strategy!r}")
        _check_positive_int(window=self.window)
        if self.active_weight_bytes > self.weight_bytes:
            raise ValueError(f"active_weight_bytes ({self.active_weight_bytes}) cannot exceed weight_bytes "
                             f"({self.weight_bytes})")

    def kv_bytes(self, context_len: int) -> float:
        """KV cache of one sequence holding `context_len` tokens."""
        _check_nonnegative(context_len=context_len)
        return self.kv_bytes_per_token * context_len + self.window_kv_bytes_per_token * min(context_len, self.window)

    def state_bytes(self, tokens_per_seq: int = 1) -> float:
        """Mamba memory of one request while verifying windows of `tokens_per_seq` tokens (`mamba_request_bytes`)."""
        if self.mamba is None:
            return 0.0
        return mamba_request_bytes(self.mamba, tokens_per_seq, self.spec_strategy)

    def state_traffic(self, tokens_per_seq: int = 1) -> float:
        """Mamba bytes one sequence reads + writes in a forward over `tokens_per_seq` tokens, all layers:
        a decode step reads and writes one state; a verify window moves what `spec_state_traffic` counts for
        the strategy, with the whole window kept (the most flushes replay can need)."""
        if self.mamba is None:
            return 0.0
        strategy = "per-position" if tokens_per_seq == 1 else self.spec_strategy
        return _state_traffic(self.mamba, tokens_per_seq, strategy)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one forward over `tokens` tokens in all (batch · tokens per sequence) reads.

        Dense: `active_weight_bytes`, once. Mixture of experts, with every weight treated as a routed expert
        that each token picks with probability f = active / total, independently of the other tokens:
        total · (1 - (1 - f)^tokens), which is `active_weight_bytes` for one token and approaches all the
        weights for a large batch. Real routing shares experts between neighbouring tokens and MoE models
        have shared parts, so this is an upper bound on the traffic of a small forward: a verify forward of
        K + 1 tokens then reads up to K + 1 times the weights of a decode step, which is why speculation
        buys a mixture of experts less than tau even at batch 1.
        """
        _check_positive_int(tokens=tokens)
        if not self.routed:
            return self.active_weight_bytes
        f = self.active_weight_bytes / self.weight_bytes
        return self.weight_bytes * (1 - (1 - f) ** tokens)


# Gemma 4 E4B, the target of Nemotron 3.5 Bolt E4B (its published DFlash drafter config: 42 target layers,
# hidden 2560, vocab 262,144). From Gemma 4's public configs (Megatron-Bridge's Gemma 4 E4B recipe;
# google/gemma.cpp PR #919): ~3.8 B parameters without the per-layer embeddings, 2 KV heads of 256 on
# sliding layers (window 512) and of 512 on the full-attention layers (every sixth), and the last 18 layers
# reuse earlier layers' KV, so 24 layers keep a cache: 4 full (layers 5, 11, 17, 23 — the ones the drafter
# taps) and 20 sliding. BF16 weights and KV; stored weights counted at 7.5 B parameters (with the per-layer
# embeddings, as fairseq2's Gemma 4 table lists E4B).
E4B_TARGET = ServedModel(
    name="Bolt E4B target (Gemma 4 E4B)",
    weight_bytes=7.5e9 * BF16_BYTES,
    active_weight_bytes=3.8e9 * BF16_BYTES,
    flops_per_token=2 * 3.8e9,
    kv_bytes_per_token=4 * 2 * 2 * 512 * BF16_BYTES,
    window_kv_bytes_per_token=20 * 2 * 2 * 256 * BF16_BYTES,
    window=512,
)


@functools.lru_cache(maxsize=64)
def _state_traffic(shape: Mamba2Shape, window: int, strategy: str) -> float:
    t = spec_state_traffic(shape, window, window, strategy)
    return shape.num_layers * (t.read_per_step + t.written_per_step)


def e4b_dflash_drafter() -> ServedModel:
    """Bolt E4B's DFlash drafter as served: NVFP4 weights (1,031,568,640 parameters at 4.5 bits), its
    20 MiB draft KV cache per sequence (every layer slides over 1024 tokens), dense."""
    n = dflash_param_count(E4B_DFLASH).total
    kv = dflash_kv_cache_bytes(E4B_DFLASH) / E4B_DFLASH.sliding_window
    return ServedModel(name="Bolt E4B DFlash drafter", weight_bytes=nvfp4_bytes(n), active_weight_bytes=nvfp4_bytes(n),
                       flops_per_token=2 * n, window_kv_bytes_per_token=kv, window=E4B_DFLASH.sliding_window)


def super_target(spec_strategy: str = "per-position") -> ServedModel:
    """Nemotron 3 Super (120 B parameters, 12 B active per token) with NVFP4 weights at the Super/Lightning
    paper's 4.82 bits per parameter, a mixture of experts, and its 40 Mamba-2 layers (fp32 SSM state, bf16
    conv window) kept per position or by checkpoint + replay while verifying.

    Its attention layers' KV cache is left out (the sources give the Mamba shapes, not the attention
    ones): memory per request is a lower bound, requests that fit an upper bound.
    """
    bits = 4.82
    return ServedModel(name="Nemotron 3 Super", weight_bytes=120e9 * bits / 8, active_weight_bytes=12e9 * bits / 8,
                       flops_per_token=2 * 12e9, routed=True, mamba=SUPER_MAMBA2, spec_strategy=spec_strategy)


def mamba_request_bytes(shape: Mamba2Shape, spec_window: int = 1, strategy: str = "per-position",
                        capacity: int = 16) -> float:
    """Mamba memory of one request over all `shape.num_layers` layers (SSM state + conv window per layer).

    Plain decoding (spec_window 1) keeps one state. Speculative verification over a window of T tokens keeps
    T states per layer with per-position states (vLLM / SGLang natively), or one checkpoint plus a ring of
    `capacity` records with checkpoint + replay (`spec_state_traffic`'s memory_per_request).
    Super, T = 4: 4 · (4 MiB + 60 KiB) per layer natively; replay 4 MiB + 16 records.
    """
    _check_positive_int(spec_window=spec_window)
    if spec_window == 1:
        strategy = "per-position"
    return shape.num_layers * spec_state_traffic(shape, spec_window, 1, strategy, capacity).memory_per_request


def forward_seconds(model: ServedModel, hw: Accelerator, batch: int, tokens_per_seq: int = 1,
                    context_len: int = 0) -> float:
    """Roofline time of one forward of `batch` sequences, `tokens_per_seq` new tokens each, after
    `context_len` tokens of context: max(bytes / bandwidth, FLOPs / peak), with
    bytes = weights read (once) + batch · (KV of the context + Mamba state read and written) and
    FLOPs = batch · tokens_per_seq · flops_per_token.
    """
    _check_positive_int(batch=batch, tokens_per_seq=tokens_per_seq)
    _check_nonnegative(context_len=context_len)
    tokens = batch * tokens_per_seq
    per_sequence = model.kv_bytes(context_len) + model.state_traffic(tokens_per_seq)
    moved = model.weight_bytes_read(tokens) + batch * per_sequence
    return max(moved / hw.bandwidth, tokens * model.flops_per_token / hw.flops)


@dataclass(frozen=True)
class Drafting:
    """How one speculative cycle drafts: K drafts, then one verify forward over K + 1 tokens per sequence.

    drafter:         the draft model, priced by `forward_seconds` like the target (None: see draft_ratio)
    passes:          drafter forwards per cycle (DFlash: 1; a recursive MTP head or EAGLE: K)
    tokens_per_pass: tokens per sequence in one pass (DFlash: the whole block, K + 1)
    draft_ratio:     without a drafter model, one pass costs this fraction of a target decode step at the
                     same batch (0: free drafts, as prompt lookup)
    """

    tau: float
    num_drafts: int
    drafter: ServedModel | None = None
    passes: int = 1
    tokens_per_pass: int = 1
    draft_ratio: float = 0.0

    def __post_init__(self) -> None:
        _check_tau(self.tau)
        _check_positive_int(num_drafts=self.num_drafts, passes=self.passes, tokens_per_pass=self.tokens_per_pass)
        _check_nonnegative(draft_ratio=self.draft_ratio)
        if self.tau > self.num_drafts + 1:
            raise ValueError(f"tau ({self.tau}) cannot exceed num_drafts + 1 = {self.num_drafts + 1}")


def speedup_at_batch(target: ServedModel, hw: Accelerator, batch: int, drafting: Drafting,
                     context_len: int = 0) -> float:
    """Section 5's speedup tau · C_t / (C_d + C_v), with each cost a forward at this batch:
    C_t = one decode step, C_v = a forward over K + 1 tokens per sequence, C_d = the drafter's passes.
    """
    c_target = forward_seconds(target, hw, batch, 1, context_len)
    c_verify = forward_seconds(target, hw, batch, drafting.num_drafts + 1, context_len)
    if drafting.drafter is None:
        c_draft = drafting.passes * drafting.draft_ratio * c_target
    else:
        c_draft = drafting.passes * forward_seconds(drafting.drafter, hw, batch, drafting.tokens_per_pass, context_len)
    return speedup(drafting.tau, c_target, c_draft, c_verify)


def break_even_batch(target: ServedModel, hw: Accelerator, drafting: Drafting, context_len: int = 0,
                     max_batch: int = 4096) -> int | None:
    """The batch from which on speculation stops paying: the smallest batch above the one where it pays most
    (on the grid of powers of two) with speedup <= 1, found by bisection. 1 if it pays at no batch on the grid;
    None if it still pays at max_batch.

    The speedup need not fall from batch 1: a mixture of experts pays little at batch 1 (a verify forward
    reads more experts than a decode step) and more once every forward reads all the experts anyway.
    """
    _check_positive_int(max_batch=max_batch)

    def gain(batch: int) -> float:
        return speedup_at_batch(target, hw, batch, drafting, context_len)

    grid = [2**i for i in range(max_batch.bit_length()) if 2**i <= max_batch]
    peak = max(grid, key=gain)
    if gain(peak) <= 1:
        return 1
    if gain(max_batch) > 1:
        return None
    low, high = peak, next((b for b in grid if b > peak and gain(b) <= 1), max_batch)  # gain(low) > 1 >= gain(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if gain(mid) > 1 else (low, mid)
    return high


def measured_break_even_batch(step_seconds: Mapping[int, tuple[float, float]], tau: float,
                              draft_ratio: float = 0.0) -> int | None:
    """The smallest measured batch at which speculation stops paying, from timings of the real forwards.

    step_seconds: batch -> (seconds of a decode step, seconds of a verify forward over K + 1 tokens), as
    `minispec.bench.timing.timed` measures them; drafting costs draft_ratio decode steps per cycle.
    None if speculation pays at every measured batch.
    """
    for batch in sorted(step_seconds):
        c_target, c_verify = step_seconds[batch]
        if speedup(tau, c_target, draft_ratio * c_target, c_verify) <= 1:
            return batch
    return None


def memory_per_request(target: ServedModel, context_len: int, drafter: ServedModel | None = None,
                       spec_window: int = 1) -> float:
    """Bytes one request keeps: the target's KV cache at `context_len` and its Mamba state while verifying
    windows of `spec_window` tokens (1: plain decoding), plus the drafter's cache (Bolt E4B's DFlash
    drafter: 20 MiB once the context fills its 1024-token window)."""
    _check_nonnegative(context_len=context_len)
    total = target.kv_bytes(context_len) + target.state_bytes(spec_window)
    if drafter is not None:
        total += drafter.kv_bytes(context_len)
    return total


def requests_that_fit(hw: Accelerator, weight_bytes: float, request_bytes: float, utilization: float = 0.9) -> int:
    """How many requests one GPU holds: floor((utilization · memory - weights) / bytes per request).

    `utilization` is the share of memory the server may use (vLLM's gpu_memory_utilization defaults to 0.9);
    activations and CUDA graphs come out of the rest. 0 when the weights alone do not fit.
    """
    _check_positive(weight_bytes=weight_bytes, request_bytes=request_bytes)
    _check_fraction(utilization=utilization)
    free = utilization * hw.memory_bytes - weight_bytes
    return max(0, math.floor(free / request_bytes))
