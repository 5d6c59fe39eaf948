"""Cost model, parameter and memory arithmetic: the published figures, worked out in code.

Read this package like a paper's appendix. Every number the project quotes about Bolt E4B's DFlash
drafter ("Nemotron 3.5 Bolt E4B: block-parallel speculation with DFlash"), NVFP4 checkpoints ("NVFP4
quantization and QAD of Nemotron 3.5 Lightning"; "Nemotron 3.5 Super and Lightning: Open, Efficient
Mixture-of-Experts Hybrid Mamba-Transformer Models for Agentic AI") or Mamba state comes out of one
short function here, and ``tests/test_costs.py`` checks each against the figure as published. One module
per part, in reading order; everything is re-exported here, so ``from minispec import costs`` reaches it all:

1. ``units``: MiB / GiB for memory payloads, GB for checkpoint sizes, as the sources use them.
2. ``dflash``: a DFlash drafter's parameters (``dflash_param_count``) and draft KV cache
   (``dflash_kv_cache_bytes``), from its ``DFlashConfig``; Bolt E4B's (``E4B_DFLASH``).
3. ``payloads``: ideal 4-bit codes, NVFP4 bits per parameter, a BF16 embedding copy.
4. ``checkpoints``: checkpoint sizes under NVFP4 with BF16 exceptions (Lightning, Super, Ultra), and from
   the tiers of each kind of parameter (``NemotronHShape``, ``SUPER_SHAPE``, ``tiered_checkpoint``).
5. ``speedup``: the speedup model of speculative decoding, its break-even point, and the window K it picks.
6. ``mamba``: Mamba-2 state and replay-record sizes, from a ``Mamba2Config`` (Super's, lightning-mini's).
7. ``serving``: accelerators (H200, B200), served-model shapes (E4B target and DFlash drafter, Super), the
   roofline by batch, the break-even batch, memory per request and requests per GPU.
"""

from minispec.costs.checkpoints import (
                                        BF16,
                                        FP8,
                                        MODELOPT_SUPER_TIERS,
                                        NVFP4,
                                        SUPER_PAPER_TIERS,
                                        SUPER_SHAPE,
                                        TIER_BITS,
                                        NemotronHShape,
                                        TieredCheckpoint,
                                        bf16_fraction_for,
                                        bf16_fraction_for_bits,
                                        mixed_bits_per_param,
                                        nemotron_h_param_groups,
                                        params_from_size,
                                        quantized_checkpoint_gb,
                                        tiered_checkpoint,
)
from minispec.costs.dflash import (
                                        E4B_DFLASH,
                                        E4B_DFLASH_CONFIG_JSON,
                                        DFlashParamCount,
                                        dflash_kv_cache_bytes,
                                        dflash_param_count,
)
from minispec.costs.mamba import (
                                        LIGHTNING_MINI_MAMBA2,
                                        LIGHTNING_MINI_MAMBA_LAYERS,
                                        SUPER_MAMBA2,
                                        SUPER_MAMBA_LAYERS,
                                        SpecStateTraffic,
                                        mamba_state_bytes,
                                        native_spec_state_writes_bytes,
                                        replay_record_bytes,
                                        spec_state_traffic,
)
from minispec.costs.payloads import embedding_bytes, ideal_4bit_code_bytes, nvfp4_bits_per_param, nvfp4_bytes
from minispec.costs.serving import (
                                        B200,
                                        E4B_TARGET,
                                        H200,
                                        Accelerator,
                                        Drafting,
                                        ServedModel,
                                        break_even_batch,
                                        e4b_dflash_drafter,
                                        forward_seconds,
                                        mamba_request_bytes,
                                        measured_break_even_batch,
                                        memory_per_request,
                                        requests_that_fit,
                                        speedup_at_batch,
                                        super_target,
)
from minispec.costs.speedup import best_window, break_even_tau, expected_tau, implied_cycle_cost, speedup
from minispec.costs.units import BF16_BITS, BF16_BYTES, GB, GiB, MiB, to_gb, to_gib, to_mib

__all__ = [
    "B200", "BF16", "BF16_BITS", "BF16_BYTES", "E4B_DFLASH", "E4B_DFLASH_CONFIG_JSON", "E4B_TARGET", "FP8", "GB",
    "GiB", "H200", "LIGHTNING_MINI_MAMBA2", "LIGHTNING_MINI_MAMBA_LAYERS", "MODELOPT_SUPER_TIERS", "MiB", "NVFP4",
    "SUPER_MAMBA2", "SUPER_MAMBA_LAYERS", "SUPER_PAPER_TIERS", "SUPER_SHAPE", "TIER_BITS", "Accelerator",
    "DFlashParamCount", "Drafting", "NemotronHShape", "ServedModel", "SpecStateTraffic", "TieredCheckpoint",
    "best_window", "bf16_fraction_for", "bf16_fraction_for_bits", "break_even_batch", "break_even_tau",
    "dflash_kv_cache_bytes", "dflash_param_count", "e4b_dflash_drafter", "embedding_bytes", "expected_tau",
    "forward_seconds", "ideal_4bit_code_bytes", "implied_cycle_cost", "mamba_request_bytes", "mamba_state_bytes",
    "measured_break_even_batch", "memory_per_request", "mixed_bits_per_param", "native_spec_state_writes_bytes",
    "nemotron_h_param_groups", "nvfp4_bits_per_param", "nvfp4_bytes", "params_from_size", "quantized_checkpoint_gb",
    "replay_record_bytes", "requests_that_fit", "spec_state_traffic", "speedup", "speedup_at_batch", "super_target",
    "tiered_checkpoint", "to_gb", "to_gib", "to_mib",
]
