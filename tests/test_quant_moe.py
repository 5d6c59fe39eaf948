"""Quantizing the hybrid MoE model: routed experts per expert (QuantExperts), Mamba and attention projections,
the Super/Lightning paper's tiers on lightning-mini, its storage, and exact speculative decoding over it."""
import copy

import pytest
import torch

import minispec as ms
from minispec import costs, quant
from minispec.quant import nvfp4
from minispec.quant.modules import QuantExperts, QuantLinear
from minispec.ssm.hybrid import HybridLM
from tiny import tiny_nemotron_h

IDS = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(0))


def calib(m):
    m(IDS)


def test_each_expert_has_its_own_scales():
    experts = HybridLM.from_hf(tiny_nemotron_h()).model.layers[2].mixer.experts
    with torch.no_grad():
        experts.up_proj[1] *= 100.0  # one loud expert must not coarsen the others' grids
    static = QuantExperts(copy.deepcopy(experts), "w4a16", "static")
    static.calibrate_weight("four_over_six")
    dynamic = QuantExperts(experts, "w4a16", "dynamic")
    dynamic.calibrate_weight("max")
    assert static.up_proj_global_scale.shape == (4,) and static.up_proj_block_scale.shape == (4, 16, 2)
    for j in range(4):
        w = experts.up_proj[j].detach()
        assert torch.equal(static.up_proj[j], nvfp4.quantize(w, four_over_six=True).dequantize())
        assert torch.equal(dynamic.up_proj[j], nvfp4.fake_quantize(w))
        assert torch.equal(dynamic.down_proj[j], nvfp4.fake_quantize(experts.down_proj[j].detach()))
    with torch.no_grad():
        experts.down_proj[3] *= 0.5  # dynamic scales, global ones included, follow the moved weight
    assert torch.equal(dynamic.down_proj[3], nvfp4.fake_quantize(experts.down_proj[3].detach()))
    # the export: one Model Optimizer NVFP4 layer per expert and projection
    packed = dynamic.packed_experts()
    assert packed["1.up_proj.weight"].shape == (16, 16) and packed["1.up_proj.weight"].dtype == torch.uint8
    assert packed["1.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert packed["1.up_proj.weight_scale_2"].dim() == 0
    t = nvfp4.NVFP4Tensor(packed["2.down_proj.weight"], packed["2.down_proj.weight_scale"],
                          packed["2.down_proj.weight_scale_2"], (32, 16))
    assert torch.equal(t.dequantize(), dynamic.down_proj[2])


def test_hf_and_minispec_models_quantize_alike_and_only_matmul_weights_train():
    hf = tiny_nemotron_h()
    q_hf = quant.quantize(copy.deepcopy(hf), quant.SUPER_TIERS, calib)
    q_ms = quant.quantize(HybridLM.from_hf(copy.deepcopy(hf)), quant.SUPER_TIERS, calib)
    for q in (q_hf, q_ms):
        f = quant.formats_of(q)
        assert f["model.layers.2.mixer.experts"] == f["model.layers.2.mixer.shared_experts.up_proj"] == "w4a16"
        assert f["model.layers.0.mixer.in_proj"] == "fp8" and f["model.layers.3.mixer.out_proj"] == "fp8"
        assert f["model.layers.1.mixer.q_proj"] == "fp8" and f["model.layers.4.mixer.up_proj"] == "w4a16"
        assert f["lm_head"] == "bf16" and isinstance(q.model.layers[2].mixer.experts, QuantExperts)
    with torch.no_grad():
        a, b, ref = q_hf(IDS).logits, q_ms(IDS).logits, hf(IDS).logits
    assert (a - b).abs().max() < 1e-4 and not torch.equal(a, ref)  # transformers' MoE calls the experts' forward
    trainable = quant.quantized_weights(q_ms)
    assert "model.layers.2.mixer.experts.up_proj" in trainable and "model.layers.0.mixer.in_proj.weight" in trainable
    assert not any(k in n for n in trainable for k in ("norm", "embeddings", "gate", "conv1d", "A_log", "lm_head"))
    q_ms(IDS).logits.square().mean().backward()  # the straight-through estimator reaches the 3-D expert weights
    grad = dict(q_ms.named_parameters())["model.layers.2.mixer.experts.up_proj"].grad
    assert grad is not None and grad.abs().sum() > 0


def test_expert_formats_and_bad_input_are_refused():
    hf = tiny_nemotron_h()
    with pytest.raises(ValueError, match="routed experts take weight-only NVFP4"):
        quant.quantize(copy.deepcopy(hf), {"rules": [["*", "w4a4"]]}, calib)
    q = quant.quantize(copy.deepcopy(hf), {"rules": [["*experts", "w4a16"]]})
    with pytest.raises(ValueError, match="already quantized"):
        quant.quantize(q, {"rules": [["*experts", "w4a16"]]})
    bad = copy.deepcopy(hf)
    with torch.no_grad():
        bad.model.layers[2].mixer.experts.down_proj[1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="experts.down_proj: it has 1 NaN"):
        quant.quantize(bad, {"rules": [["*experts", "w4a16"]]})


@pytest.fixture(scope="module")
def lightning():
    hf, tok = ms.load_target("lightning-mini")
    prompt = ms.load_evalset().prompts[5][None]
    model = quant.quantize(HybridLM.from_hf(copy.deepcopy(hf)), quant.SUPER_TIERS, lambda m: m(prompt))
    return hf, model, prompt


def test_super_tiers_on_lightning_mini_count_every_tier(lightning):
    hf, model, _ = lightning
    r = quant.storage_report(model)
    tiers = r["params_by_format"]
    assert sum(tiers.values()) == r["params"] == sum(p.numel() for p in hf.parameters())
    experts = sum(m.up_proj.numel() + m.down_proj.numel() for m in model.modules() if isinstance(m, QuantExperts))
    linear = {f: sum(m.weight.numel() for m in model.modules() if isinstance(m, QuantLinear) and m.format == f)
              for f in ("w4a16", "fp8")}
    assert tiers["w4a16"] == experts + linear["w4a16"] and tiers["fp8"] == linear["fp8"] > 0
    assert r["nvfp4_codes"] == tiers["w4a16"] // 2 and r["nvfp4_block_scales"] == tiers["w4a16"] // 16
    assert r["fp8_weights"] == tiers["fp8"] and r["bf16"] == 2 * tiers["bf16"] + 4 * sum(  # + fp32 buffers
        b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    bits = (4.5 * tiers["w4a16"] + 8 * tiers["fp8"] + 8 * (r["bf16"] + r["tensor_scales"])) / r["params"]
    assert r["bits_per_param"] == pytest.approx(bits)
    # the arithmetic that reproduces Nemotron 3 Super's checkpoint, on lightning-mini's shapes, counts the same tiers
    counted = costs.tiered_checkpoint(costs.NemotronHShape.from_hf_config(hf.config.to_dict()))
    assert counted.params_by_tier == {"nvfp4": tiers["w4a16"], "fp8": tiers["fp8"], "bf16": tiers["bf16"]}
    assert r["bits_per_param"] == pytest.approx(counted.bits_per_param, rel=2e-3)  # + scales and fp32 buffers


@pytest.mark.parametrize("drafter_name", ["mtp", "ngram"])
def test_speculative_decoding_with_the_quantized_model_equals_its_own_greedy_output(lightning, drafter_name):
    _, model, prompt = lightning
    ar = ms.autoregressive_generate(model, prompt, 24).tokens
    spec = ms.speculative_generate(model, ms.load_drafter(drafter_name, model, num_draft_tokens=3), prompt, 24)
    assert torch.equal(spec.tokens, ar)
    assert any(c.accepted > 0 for c in spec.stats.verifications)


def test_a_quantized_hf_model_decodes_as_its_hybrid_lm(lightning):
    """`HybridLM.from_hf` keeps the quantized modules of a quantized transformers model: both loops drive it
    (through the target adapter) to the same greedy output as the quantized HybridLM."""
    hf, _, prompt = lightning
    hf_q = quant.quantize(copy.deepcopy(hf), quant.SUPER_TIERS, lambda m: m(prompt))
    own = quant.quantize(HybridLM.from_hf(copy.deepcopy(hf)), quant.SUPER_TIERS, lambda m: m(prompt))
    ar = ms.autoregressive_generate(hf_q, prompt, 16).tokens
    assert torch.equal(ar, ms.autoregressive_generate(own, prompt, 16).tokens)
    spec = ms.speculative_generate(hf_q, ms.load_drafter("ngram", hf_q, num_draft_tokens=3), prompt, 16)
    assert torch.equal(spec.tokens, ar)
