"""The published figures, reproduced by minispec.costs.

Exact integers where the source gives exact integers; otherwise the precision the source quotes
(0.1 MiB, 3 significant figures, "~"). Sources: "Nemotron 3.5 Bolt E4B: block-parallel speculation
with DFlash" (the E4B drafter and its config.json), "NVFP4 quantization and QAD of Nemotron 3.5
Lightning", "Nemotron 3.5 Super and Lightning: Open, Efficient Mixture-of-Experts Hybrid
Mamba-Transformer Models for Agentic AI", and the repositories named at each test.
"""

import math

import pytest
import torch

from minispec import costs
from minispec.costs import (
    E4B_DFLASH,
    GB,
    SUPER_MAMBA2,
    GiB,
    MiB,
    dflash_kv_cache_bytes,
    dflash_param_count,
)
from minispec.dflash.config import config_from_hf_dflash

# z-lab's Qwen3-8B drafter (its HF config.json, as SpecForge's configs/qwen3-8b-dflash.json repeats it).
ZLAB_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"], "hidden_size": 4096, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
    "num_target_layers": 36, "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False,
}


def sig3(x: float) -> float:
    """Round to 3 significant figures, the precision the sources quote."""
    return float(f"{x:.3g}")


# --- DFlash parameters ---------------------------------------------------------------------


def test_e4b_drafter_has_exactly_1_031_568_640_parameters():
    count = dflash_param_count(E4B_DFLASH)
    assert count.total == 1_031_568_640


def test_e4b_breakdown_part_by_part():
    parts = dflash_param_count(E4B_DFLASH).as_dict()
    assert parts == {
        "embed_tokens": 0,  # shared with the target
        "fc": 5 * 2560 * 2560,  # 32,768,000
        "hidden_norm": 2560,
        "attention": 5 * (2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 2 * 128),
        "mlp": 5 * 3 * 2560 * 5120,
        "layer_norms": 5 * 2 * 2560,
        "norm": 2560,
        "lm_head": 262_144 * 2560,  # 671,088,640
        "total": 1_031_568_640,
    }
    # Without its head the Bolt drafter is about 360 M parameters (5 layers, fc and norms).
    assert parts["total"] - parts["lm_head"] == 360_480_000


def test_e4b_head_is_65_1_percent():
    count = dflash_param_count(E4B_DFLASH)
    assert round(100 * count.fraction("lm_head"), 1) == 65.1


def test_zlab_qwen3_8b_drafter_is_about_1_05_billion():
    # z-lab's Qwen3-8B drafter (its HF config.json, as SpecForge's configs/qwen3-8b-dflash.json repeats it):
    # ~0.97 B in the layers, ~84 M in fc, ~1.05 B in total; no own head.
    qwen3_8b = config_from_hf_dflash(ZLAB_QWEN3_8B, has_lm_head=False)
    count = dflash_param_count(qwen3_8b)
    assert count.lm_head == count.embed_tokens == 0
    assert count.layers / 1e9 == pytest.approx(0.97, abs=0.01)  # 964.7 M: "about 0.97 B"
    assert round(count.fc / 1e6) == 84
    assert round(count.total / 1e9, 2) == 1.05


def e4b(**changes):
    """Bolt E4B's drafter with some top-level config.json keys changed."""
    return config_from_hf_dflash({**costs.E4B_DFLASH_CONFIG_JSON, **changes}, has_lm_head=True)


def test_own_embedding_and_bias_are_counted():
    assert dflash_param_count(E4B_DFLASH, has_embed_tokens=True).total == 1_031_568_640 + 262_144 * 2560
    with_bias = e4b(attention_bias=True)
    assert dflash_param_count(with_bias).total - 1_031_568_640 == 5 * (4096 + 2 * 1024 + 2560)


# --- DFlash config reading -------------------------------------------------------------------


def test_the_published_e4b_config_reads_as_published():
    assert (E4B_DFLASH.target_layer_ids, E4B_DFLASH.num_target_layers, E4B_DFLASH.block_size) == \
        ([5, 11, 17, 23, 35], 42, 8)
    assert E4B_DFLASH.layer_types == ["sliding_attention"] * 5 and E4B_DFLASH.sliding_window == 1024
    assert E4B_DFLASH.has_own_lm_head and E4B_DFLASH.target_hidden_size == 2560


def test_zlab_configs_share_the_head_and_have_no_window():
    shape = config_from_hf_dflash(ZLAB_QWEN3_8B, has_lm_head=False)
    assert (shape.num_taps, shape.has_own_lm_head, shape.sliding_window) == (5, False, None)
    # Taps need not equal layers (z-lab Qwen3.5-35B: 6 layers, 8 taps); fc follows the taps.
    wide = config_from_hf_dflash({**ZLAB_QWEN3_8B, "dflash_config": {"mask_token_id": 151669,
                                                                     "target_layer_ids": list(range(8))}}, False)
    assert dflash_param_count(wide).fc == 8 * 4096 * 4096


def test_from_hf_config_rejects_bad_configs():
    with pytest.raises(ValueError, match="hidden_size"):
        config_from_hf_dflash({k: v for k, v in costs.E4B_DFLASH_CONFIG_JSON.items() if k != "hidden_size"}, True)
    published = costs.E4B_DFLASH_CONFIG_JSON
    bad_ids = {**published, "dflash_config": {**published["dflash_config"], "target_layer_ids": [5, 42]}}
    with pytest.raises(ValueError, match="out of range"):
        config_from_hf_dflash(bad_ids, True)


# --- Draft KV cache and weight payloads ------------------------------------------------------


def test_e4b_draft_kv_cache_is_20_mib_per_sequence():
    per_seq = dflash_kv_cache_bytes(E4B_DFLASH)
    assert per_seq == 5 * 8 * 1024 * 128 * 2 * 2 == 20 * MiB
    assert dflash_kv_cache_bytes(E4B_DFLASH, num_sequences=64) == 1.25 * GiB
    # The window caps the cache: a 100k-token context costs the same; a short one costs less.
    assert dflash_kv_cache_bytes(E4B_DFLASH, context_len=100_000) == 20 * MiB
    assert dflash_kv_cache_bytes(E4B_DFLASH, context_len=512) == 10 * MiB


def test_full_attention_cache_grows_with_context():
    types = ("sliding_attention",) * 4 + ("full_attention",)
    mixed = e4b(layer_types=list(types))
    # 4 sliding layers at 1024 plus one full layer at 8192 positions; 4 KiB per position per layer.
    assert dflash_kv_cache_bytes(mixed, context_len=8192) == (4 * 1024 + 8192) * 4096
    with pytest.raises(ValueError, match="full attention"):
        dflash_kv_cache_bytes(mixed)


def test_ideal_4bit_codes_are_491_9_mib_and_head_320_mib():
    count = dflash_param_count(E4B_DFLASH)
    assert round(costs.to_mib(costs.ideal_4bit_code_bytes(count.total)), 1) == 491.9
    assert costs.ideal_4bit_code_bytes(count.lm_head) == 320 * MiB


def test_bf16_embedding_copy_is_1_25_gib():
    assert costs.embedding_bytes(262_144, 2560) == 1.25 * GiB


# --- NVFP4 checkpoints -------------------------------------------------------------------------


def test_nvfp4_is_4_5_bits_per_parameter():
    assert costs.nvfp4_bits_per_param() == 4.5  # 4-bit E2M1 code + 8-bit E4M3 scale / 16
    assert costs.nvfp4_bytes(16) == 9  # 16 codes of 4 bits + one scale byte


def test_lightning_66_gb_becomes_about_22_gb_with_bf16_exceptions():
    all_nvfp4 = costs.quantized_checkpoint_gb(66, bf16_fraction=0.0)
    assert all_nvfp4 == 66 * 4.5 / 16 == 18.5625  # too small: something stays in BF16
    f = costs.bf16_fraction_for(66, 22)
    assert f == pytest.approx((16 * 22 / 66 - 4.5) / 11.5)
    assert round(100 * f, 1) == 7.2  # ~2.4 B of 33 B parameters in BF16
    assert 0.03 < f < 0.15  # a plausible share for embeddings, attention, norms, routers, MTP
    assert round(costs.quantized_checkpoint_gb(66, bf16_fraction=round(f, 3))) == 22


def test_super_75_gb_at_4_82_bits_is_about_124_billion_parameters():
    n = costs.params_from_size(75 * GB, 4.82)
    assert sig3(n / 1e9) == 124
    assert abs(n / 120e9 - 1) < 0.05  # consistent with the nominal "120B-A12B"
    # Reading "75 GB" as GiB would give 134 B: further from 120 B, so GB is the right unit.
    assert sig3(costs.params_from_size(75 * GiB, 4.82) / 1e9) == 134
    # A two-tier reading (BF16 + NVFP4 only) of 4.82 bits gives 2.8 % BF16; the recipe has an FP8 tier too,
    # so this is not Super's BF16 share (see test_super_bits_and_size_from_the_tiers).
    assert round(100 * costs.bf16_fraction_for_bits(4.82), 1) == 2.8


def test_super_param_count_from_its_published_shapes():
    g = costs.nemotron_h_param_groups(costs.SUPER_SHAPE)
    mtp = 512 * 2 * 2688 * 1024 + 2 * 4096 * 5376 + 2 * 4096 * 1024 + 512 * 4096  # the MTP block's MoE layer
    mtp += 2 * 4096 * 4096 + 2 * 4096 * 256  # its attention layer: q, o [4096, 4096]; k, v [256, 4096]
    mtp += 2 * 4096 * 4096 + 3 * 4096 + 2 * 4096  # its input projection [H, 2H], three norms, two layer norms
    main = sum(g.values()) - mtp
    assert round(main / 1e9, 2) == 120.67  # "120B-A12B", without the MTP block
    assert sig3(sum(g.values()) / 1e9) == 124  # = 75 GB / 4.82 bits (test above)
    assert g["routed_experts"] == 41 * 512 * 2 * 2688 * 1024  # 40 MoE layers + the MTP block's
    assert g["mamba_projections"] == 40 * (4096 * (2 * 8192 + 2 * 1024 + 128) + 8192 * 4096)
    assert g["attention"] == 9 * (2 * 4096 * 4096 + 2 * 4096 * 256)


def test_super_bits_and_size_from_the_tiers():
    t = costs.tiered_checkpoint(costs.SUPER_SHAPE)
    tiers = {k: round(v / 1e9, 2) for k, v in t.params_by_tier.items()}
    assert tiers == {"nvfp4": 117.37, "fp8": 4.70, "bf16": 1.54}
    assert round(t.bits_per_param, 2) == 4.78  # the paper: 4.82
    assert abs(t.bits_per_param / 4.82 - 1) < 0.01
    assert round(t.total_bytes / GB, 1) == 73.8  # the paper: ~75 GB
    assert abs(t.total_bytes / (75 * GB) - 1) < 0.02
    # every parameter in its tier: the bits add up, and all-BF16 is the 16-bit baseline
    assert t.bits == pytest.approx(4.5 * t.params_by_tier["nvfp4"] + 8 * t.params_by_tier["fp8"]
                                   + 16 * t.params_by_tier["bf16"])
    assert costs.tiered_checkpoint(costs.SUPER_SHAPE, {}).bits_per_param == 16
    with pytest.raises(ValueError, match="unknown kinds"):
        costs.tiered_checkpoint(costs.SUPER_SHAPE, {"experts": "nvfp4"})
    with pytest.raises(ValueError, match="unknown tiers"):
        costs.tiered_checkpoint(costs.SUPER_SHAPE, {"routed_experts": "int4"})
    with pytest.raises(ValueError, match="pattern letters"):
        costs.NemotronHShape(**{**costs.SUPER_SHAPE.__dict__, "pattern": "MX"})


def test_super_paper_figure_lies_between_its_tiers_and_model_optimizers_map():
    modelopt = costs.tiered_checkpoint(costs.SUPER_SHAPE, costs.MODELOPT_SUPER_TIERS)
    assert round(modelopt.bits_per_param, 2) == 4.85
    assert round(modelopt.total_bytes / GB, 1) == 74.9
    paper_tiers = costs.tiered_checkpoint(costs.SUPER_SHAPE)
    assert paper_tiers.bits_per_param < 4.82 < modelopt.bits_per_param
    assert modelopt.params == paper_tiers.params  # the same parameters, only their tiers moved


def test_ultra_blog_figure_needs_a_small_bf16_share():
    # Nemotron-3-Ultra's NVFP4 release (Model Optimizer recipe ptq/nvfp4-4o6.yaml): 1,121 GB -> 352.3 GB.
    f = costs.bf16_fraction_for(1121, 352.3)
    assert 0.0 < f < 0.1
    assert costs.quantized_checkpoint_gb(1121, f) == pytest.approx(352.3)


def test_checkpoint_arithmetic_rejects_nonsense():
    with pytest.raises(ValueError, match="bf16_fraction"):
        costs.quantized_checkpoint_gb(66, bf16_fraction=1.5)
    with pytest.raises(ValueError, match="bf16_gb"):
        costs.quantized_checkpoint_gb(-66, bf16_fraction=0.1)
    with pytest.raises(ValueError, match="no BF16 fraction"):
        costs.bf16_fraction_for(66, 10)  # below 4.5 bits/param
    with pytest.raises(ValueError, match="bits_per_param"):
        costs.params_from_size(75 * GB, 0)


# --- Speedup model -----------------------------------------------------------------------------


def test_speedup_model():
    assert costs.speedup(tau=4, c_target=1, c_draft=0, c_verify=1) == 4  # free drafts: speedup = tau
    assert costs.speedup(tau=6, c_target=10, c_draft=5, c_verify=15) == 3  # 6·10 / (5+15)
    tau_star = costs.break_even_tau(c_target=10, c_draft=5, c_verify=15)
    assert tau_star == 2
    assert costs.speedup(tau_star, 10, 5, 15) == pytest.approx(1.0)


def test_implied_cycle_cost_from_zlab_readme():
    # z-lab/dflash README at its first commit (bb48ef9), Qwen3-8B, GSM8K, T=0: speedup / tau.
    dflash = costs.implied_cycle_cost(tau=6.55, measured_speedup=5.20)
    eagle3 = costs.implied_cycle_cost(tau=2.89, measured_speedup=2.13)
    assert round(dflash, 2) == 1.26
    assert round(eagle3, 2) == 1.36
    assert costs.speedup(6.55, 1, 0, dflash) == pytest.approx(5.20)


def test_speedup_rejects_nonsense():
    with pytest.raises(ValueError, match="tau >= 1"):
        costs.speedup(tau=0.5, c_target=1, c_draft=0.1, c_verify=1)
    with pytest.raises(ValueError, match="c_draft"):
        costs.speedup(tau=3, c_target=1, c_draft=-0.1, c_verify=1)
    with pytest.raises(ValueError, match="c_target"):
        costs.break_even_tau(c_target=0, c_draft=0.1, c_verify=1)
    with pytest.raises(ValueError, match="tau"):
        costs.speedup(tau=math.nan, c_target=1, c_draft=0, c_verify=1)


# --- Shapes and Mamba state -------------------------------------------------------------------


def test_a_drafter_config_rejects_nonsense():
    with pytest.raises(ValueError, match="hidden_size"):
        e4b(hidden_size=-2560)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        e4b(num_key_value_heads=7)
    with pytest.raises(ValueError, match="DFlashConfig"):
        dflash_param_count(costs.E4B_DFLASH_CONFIG_JSON)
    with pytest.raises(ValueError, match="context_len"):
        dflash_kv_cache_bytes(E4B_DFLASH, context_len=0)


def test_super_mamba_state_and_replay_record():
    # Nemotron 3 Super's Mamba-2 shapes; ReplaySSM's record (Johnny-Liou/ReplaySSM): x, B in bf16, dt in fp32.
    state = costs.mamba_state_bytes(SUPER_MAMBA2)
    assert state == 128 * 64 * 128 * 4 == 4 * MiB
    record = costs.replay_record_bytes(SUPER_MAMBA2)
    assert record == 18_944
    assert round(100 * record / state, 2) == 0.45
    assert round(costs.to_mib(32 * record), 2) == 0.58  # a 32-record ring per layer
    assert (state + 32 * record) / state == pytest.approx(1.15, abs=0.01)  # "about 1.15x"
    assert costs.native_spec_state_writes_bytes(SUPER_MAMBA2, num_tokens=4) == 20 * MiB
    assert costs.native_spec_state_writes_bytes(SUPER_MAMBA2, num_tokens=1) == 8 * MiB


def test_expected_tau_is_one_plus_the_chance_of_reaching_each_draft():
    # a = (0.5, 0.5): draft 1 accepted half the time, both a quarter: 1 + 0.5 + 0.25.
    assert costs.expected_tau([0.5, 0.5]) == pytest.approx(1.75)
    assert costs.expected_tau([1.0] * 7) == pytest.approx(8.0)  # every draft accepted: K + 1
    assert costs.expected_tau([0.0, 1.0, 1.0]) == pytest.approx(1.0)  # nothing past a certain rejection counts
    with pytest.raises(ValueError, match="probabilities"):
        costs.expected_tau([0.5, 1.2])
    with pytest.raises(ValueError, match="at least one"):
        costs.expected_tau([])


def test_expected_tau_matches_the_tau_of_simulated_cycles():
    # Cycles whose drafts are accepted with these conditional rates, counted as SpecStats counts them.
    from minispec.speculative.stats import CycleRecord, SpecStats

    rates = [0.6, 0.4, 0.3, 0.2]
    g = torch.Generator().manual_seed(0)
    cycles = []
    for i in range(20000):
        accepted = 0
        while accepted < len(rates) and torch.rand((), generator=g) < rates[accepted]:
            accepted += 1
        cycles.append(CycleRecord(i + 1, 0, len(rates), accepted, [], []))
    stats = SpecStats(cycles)
    assert costs.expected_tau(stats.per_position.tolist()) == pytest.approx(stats.tau, abs=1e-6)  # float32 rates
    assert stats.tau == pytest.approx(costs.expected_tau(rates), abs=0.02)  # 20,000 cycles: sd ~ 0.006


def test_best_window_trades_acceptance_against_the_verify_cost():
    a = [0.33, 0.2, 0.15, 0.12, 0.1, 0.1, 0.1]
    K = range(1, 8)
    # A verify as cheap as a decode step at every window: the longest window costs nothing more, so it wins.
    assert costs.best_window(a, 1.0, dict.fromkeys(K, 0.1), dict.fromkeys(K, 1.0)) == 7
    # A verify that costs 10 % more per token: the later drafts (accepted ~0.02 % of the time) do not pay.
    k = costs.best_window(a, 1.0, dict.fromkeys(K, 0.1), {k: 1 + 0.1 * k for k in K})
    assert k == 1
    assert costs.best_window([1.0] * 7, 1.0, dict.fromkeys(K, 0.1), {k: 1 + 0.1 * k for k in K}) == 7
    with pytest.raises(ValueError, match="same K"):
        costs.best_window(a, 1.0, {1: 0.1}, {2: 1.0})
    with pytest.raises(ValueError, match="1 .. 2"):
        costs.best_window(a[:2], 1.0, {3: 0.1}, {3: 1.0})
