"""Checkpoint sizes: NVFP4 with BF16 exceptions, and from the tiers of each kind of parameter.

A quantized checkpoint keeps some modules in BF16 (embeddings, attention, norms, routers, MTP: the
Nemotron recipes in Model Optimizer's modelopt_recipes). With a fraction f of the parameters in BF16
and the rest NVFP4:

    bits per parameter  b = 16·f + 4.5·(1 − f)
    quantized size      S_q = S_bf16 · b / 16

Nemotron-3.5-Lightning ("NVFP4 quantization and QAD of Nemotron 3.5 Lightning"): 66 GB in BF16.
All-NVFP4 would be 66 · 4.5/16 = 18.56 GB; the quoted ~22 GB needs
f = (22/66 − 4.5/16) / (1 − 4.5/16) = 7.2 % of the parameters in BF16, about 2.4 B of its 33 B.
Model Optimizer's Lightning recipe (ptq/w4a16_nvfp4_4o6.yaml) names the modules (attention
projections, embeddings, routers, norms, conv1d and the MTP subtree in BF16, Mamba in/out_proj in
FP8) but not the split by parameter count, so f is solved for, not reproduced: solving f from 66 and
22 GB reproduces them by construction; it is not a check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minispec.costs.payloads import nvfp4_bits_per_param
from minispec.costs.units import BF16_BITS, check_fraction, check_positive, check_positive_int
from minispec.ssm.config import Mamba2Config


def mixed_bits_per_param(bf16_fraction: float, quant_bits: float | None = None) -> float:
    """Average bits per parameter with ``bf16_fraction`` kept in BF16: 16·f + b_q·(1 − f).

    ``quant_bits`` defaults to NVFP4's 4.5.
    """
    check_fraction(bf16_fraction=bf16_fraction)
    quant_bits = nvfp4_bits_per_param() if quant_bits is None else quant_bits
    check_positive(quant_bits=quant_bits)
    return BF16_BITS * bf16_fraction + quant_bits * (1 - bf16_fraction)


def quantized_checkpoint_gb(bf16_gb: float, bf16_fraction: float, quant_bits: float | None = None) -> float:
    """GB of a checkpoint after quantizing a ``bf16_gb`` BF16 checkpoint, keeping a fraction in BF16.

    S_q = S_bf16 · (16·f + 4.5·(1 − f)) / 16. Lightning: 66 GB, f = 7.2 % -> 22.0 GB.
    """
    check_positive(bf16_gb=bf16_gb)
    return bf16_gb * mixed_bits_per_param(bf16_fraction, quant_bits) / BF16_BITS


def bf16_fraction_for(bf16_gb: float, quantized_gb: float, quant_bits: float | None = None) -> float:
    """Fraction of parameters kept in BF16 that turns ``bf16_gb`` into ``quantized_gb``.

    Solve S_q / S_bf16 = (16·f + b_q·(1 − f)) / 16 for f:  f = (16·S_q/S_bf16 − b_q) / (16 − b_q).
    Lightning: (16·22/66 − 4.5) / 11.5 = 0.0725.
    """
    check_positive(bf16_gb=bf16_gb, quantized_gb=quantized_gb)
    quant_bits = nvfp4_bits_per_param() if quant_bits is None else quant_bits
    check_positive(quant_bits=quant_bits)
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
    check_positive(bits_per_param=bits_per_param, quant_bits=quant_bits)
    if not quant_bits <= bits_per_param <= BF16_BITS or quant_bits >= BF16_BITS:
        raise ValueError(f"bits_per_param must lie in [{quant_bits}, 16], got {bits_per_param}")
    return (bits_per_param - quant_bits) / (BF16_BITS - quant_bits)


def params_from_size(size_bytes: float, bits_per_param: float) -> float:
    """Parameter count implied by a weight payload: N = bytes · 8 / bits per parameter.

    Nemotron 3 Super: ~75 GB of weights at 4.82 bits/param -> 75e9 · 8 / 4.82 = 124 B parameters,
    consistent with its 120.7 B plus the one 2.9 B MTP head Nemotron 3.5 Super keeps (123.6 B, counted by
    ``nemotron_h_param_groups``).
    Pass GB as ``75 * GB``: the sources quote checkpoint sizes in GB (10**9 bytes).
    """
    check_positive(size_bytes=size_bytes, bits_per_param=bits_per_param)
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
        check_positive_int(hidden_size=self.hidden_size, vocab_size=self.vocab_size)

    def mamba_config(self) -> Mamba2Config:
        """The Mamba-2 mixer of every M layer (`minispec.ssm.config.Mamba2Config`)."""
        return Mamba2Config(hidden_size=self.hidden_size, num_heads=self.mamba_num_heads, head_dim=self.mamba_head_dim,
                            state_size=self.ssm_state_size, n_groups=self.n_groups, conv_kernel=self.conv_kernel)

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
# 128); hidden 4096, vocabulary 131,072, untied head; one MTP block of an attention and a MoE layer: the one
# head Nemotron 3.5 Super keeps (the Super/Lightning paper: Nemotron 3 Super had two non-shared MTP heads, 3.5
# keeps only the first). That 3.5 Super keeps 3 Super's backbone shapes is this project's assumption. Only the
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
