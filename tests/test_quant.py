"""minispec.quant.quantize and its layers: STE, formats, calibration, recipes, storage, bad input."""
import copy

import pytest
import torch
from torch import nn

from minispec import quant
from minispec.quant import nvfp4
from minispec.quant.modules import PackedLinear, QuantLinear, e4m3_signed, fp8_fake, mse_block_scales, nvfp4_fake, ste
from tiny import tiny_gemma


@pytest.fixture(scope="module")
def model():
    return tiny_gemma(layers=2, seed=0)


def ids(seed=0, n=2, t=24):
    return torch.randint(4, 4096, (n, t), generator=torch.Generator().manual_seed(seed))


def calib_loop(m):
    m(input_ids=ids(1))


def test_ste_forward_is_fake_quant_and_backward_is_identity():
    w = torch.randn(8, 32, requires_grad=True)
    g = nvfp4.global_scale_from_amax(w.detach().abs().amax())
    out = ste(w, nvfp4_fake(w.detach(), g))
    assert torch.equal(out.detach(), nvfp4.fake_quantize(w.detach()))
    (out * torch.arange(32.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(32.0).expand(8, 32))


def test_static_nvfp4_layer_equals_reference_quantize():
    lin = nn.Linear(32, 8, bias=False)
    q = QuantLinear(lin, "w4a16")
    q.calibrate_weight("max")
    x = torch.randn(3, 32)
    want = x @ nvfp4.quantize(lin.weight.detach()).dequantize().T
    assert torch.allclose(q(x), want, atol=1e-6)
    q46 = QuantLinear(lin, "w4a16")
    q46.calibrate_weight("four_over_six")
    want46 = x @ nvfp4.quantize(lin.weight.detach(), four_over_six=True).dequantize().T
    assert torch.allclose(q46(x), want46, atol=1e-6)


def test_dynamic_scales_follow_the_weight_static_scales_do_not():
    torch.manual_seed(0)
    lin = nn.Linear(32, 4, bias=False)
    static, dynamic = QuantLinear(lin, "w4a16", "static"), QuantLinear(lin, "w4a16", "dynamic")
    static.calibrate_weight("max")
    dynamic.calibrate_weight("max")
    g0 = static.weight_global_scale.clone()
    with torch.no_grad():
        lin.weight[0, :16] *= 0.1  # shrink one block: its dynamic scale shrinks, the static one stays
    w = lin.weight.detach()
    assert torch.equal(dynamic.quantized_weight().detach(), nvfp4.fake_quantize(w))
    static_hat = static.quantized_weight().detach()
    assert not torch.equal(static_hat, dynamic.quantized_weight().detach())
    assert torch.equal(static_hat, nvfp4_fake(w, g0, static.weight_block_scale))
    with torch.no_grad():
        lin.weight.mul_(3.0)  # the tensor's amax moves: a dynamic global scale follows it, the static one does not
    g, _ = dynamic.weight_scales("weight")
    assert g == nvfp4.global_scale_from_amax(lin.weight.detach().abs().amax()) and g != g0
    assert torch.equal(dynamic.quantized_weight().detach(), nvfp4.fake_quantize(lin.weight.detach()))
    assert torch.equal(static.weight_scales("weight")[0], g0)
    p = PackedLinear("w4a16", dynamic.packed_weight(), 32, 4)  # the export uses the scales the forward used
    assert torch.equal(p.nvfp4_weight().dequantize(), nvfp4.fake_quantize(lin.weight.detach()))


def test_recipes_pair_calibration_and_scales_as_the_lightning_report():
    assert quant.check_recipe({"rules": [["*", "w4a16"]]})["scales"] == "dynamic"  # max -> dynamic
    for algorithm in ("mse", "four_over_six"):
        assert quant.check_recipe({"algorithm": algorithm, "rules": [["*", "w4a16"]]})["scales"] == "static"
    for r in (quant.AGGRESSIVE, quant.AGGRESSIVE_HEAD_BF16, quant.AGGRESSIVE_HEAD_BF16_4O6, quant.AGGRESSIVE_W4A4,
              quant.LIGHTNING_LIKE, quant.SUPER_TIERS):
        assert quant.check_recipe(r)["scales"] == quant.SCALES_OF[r["algorithm"]], r["name"]
    with pytest.raises(ValueError, match="'max' goes with scales='dynamic', not 'static'.*recomputes"):
        quant.check_recipe({"algorithm": "max", "scales": "static", "rules": [["*", "w4a16"]]})
    with pytest.raises(ValueError, match="'four_over_six' goes with scales='static', not 'dynamic'.*undo"):
        quant.check_recipe({"algorithm": "four_over_six", "scales": "dynamic", "rules": [["*", "w4a16"]]})
    with pytest.raises(ValueError, match="'mse' goes with scales='static'"):
        quant.check_recipe({"algorithm": "mse", "scales": "dynamic", "rules": [["*", "w4a16"]]})


def test_quantized_weights_are_the_weights_of_quantized_matmuls_only(model):
    m = quant.quantize(copy.deepcopy(model), {"rules": [["*layers.1.*", "bf16"], ["*", "w4a16"]]})
    trainable = quant.quantized_weights(m)
    layers = {n for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    # the tied head is listed once, under the embedding's name
    assert {n.rpartition(".")[0] for n in trainable} == layers - {"lm_head"} | {"model.embed_tokens"}
    params = dict(m.named_parameters())
    assert all(params[n] is p for n, p in trainable.items())  # the Parameters themselves, under their names
    assert trainable["model.embed_tokens.weight"] is m.lm_head.weight
    assert not any("norm" in n or "layers.1." in n or n.endswith("bias") for n in trainable)
    with pytest.raises(ValueError, match="no quantized layer"):
        quant.quantized_weights(model)


def test_head_bf16_recipe_keeps_the_tied_head_exact(model):
    m = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE_HEAD_BF16)
    fm = quant.formats_of(m)
    assert fm.pop("lm_head") == "bf16" and set(fm.values()) == {"w4a16"} and len(fm) > 0
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(m.lm_head.weight, model.lm_head.weight)
    assert "model.embed_tokens.weight" not in quant.quantized_weights(m)  # QAD leaves the head/embedding alone


def test_mse_never_worse_than_max_and_fp8_rounding():
    torch.manual_seed(1)
    w = torch.randn(64, 128) * torch.rand(64, 1)
    g = nvfp4.global_scale_from_amax(w.abs().amax())
    blocks = w.reshape(64, -1, 16)
    max_err = nvfp4.block_squared_error(blocks, nvfp4.block_scales(blocks.abs().amax(-1), g), g)
    mse_err = nvfp4.block_squared_error(blocks, mse_block_scales(w, g), g)
    assert (mse_err <= max_err).all() and mse_err.sum() < 0.97 * max_err.sum()
    x = torch.tensor([0.0, -1.0625, 1.0625, 500.0, -1e-4, 0.017])
    assert e4m3_signed(x).tolist() == pytest.approx([0.0, -1.0, 1.0, 448.0, -0.0, 0.017578125])
    assert torch.equal(fp8_fake(torch.tensor([2.0, 900.0]), torch.tensor(2.0)), torch.tensor([2.0, 896.0]))


def test_quantize_model_formats_ties_and_calibration(model):
    m = copy.deepcopy(model)
    recipe = {"name": "t", "rules": [["*self_attn.q_proj", "fp8"], ["*mlp*", "w4a4"], ["*layers.1.*", "bf16"],
                                     ["*", "w4a16"]]}
    quant.quantize(m, recipe, calib_loop)
    fm = quant.formats_of(m)
    assert fm["model.layers.0.self_attn.q_proj"] == "fp8" and fm["model.layers.1.mlp.up_proj"] == "w4a4"
    assert fm["model.layers.1.self_attn.k_proj"] == "bf16" and fm["lm_head"] == "w4a16"
    assert isinstance(m.model.layers[1].self_attn.k_proj, nn.Linear)
    assert m.lm_head.weight is m.model.embed_tokens.weight  # the tie survives
    assert m.model.layers[0].mlp.up_proj.input_amax > 0
    with torch.no_grad():
        a, b = model(input_ids=ids()).logits, m(input_ids=ids()).logits
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert not torch.equal(a, b) and cos > 0.8, cos


def test_storage_is_measured_from_packed_tensors(model):
    m = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE)
    r = quant.storage_report(m)
    lin = {n: mod for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    n_q = sum(q.weight.numel() for q in lin.values())
    assert r["nvfp4_codes"] == n_q // 2 and r["nvfp4_block_scales"] == n_q // 16
    assert r["tensor_scales"] == 4 * len(lin)
    # BF16 exceptions: the embedding (its tied head is stored again, packed), norms
    others = sum(p.numel() for n, p in m.named_parameters() if not any(n.startswith(k + ".") for k in lin))
    assert r["bf16"] == 2 * others + sum(b.numel() * b.element_size() for n, b in m.named_buffers()
                                         if n in m.state_dict() and not any(n.startswith(k + ".") for k in lin))
    assert r["bits_per_param"] == pytest.approx(8 * r["total_bytes"] / r["params"])
    packed = quant.packed_state(m)
    assert packed["lm_head.weight"].dtype == torch.uint8 and packed["lm_head.weight_scale"].dtype == torch.float8_e4m3fn


def test_packed_linear_serves_the_same_outputs():
    torch.manual_seed(2)
    lin = nn.Linear(64, 16, bias=True)
    lin.bias.data = lin.bias.data.bfloat16().float()  # stored as a BF16 exception
    x = torch.randn(5, 64)
    for fmt in ("w4a16", "w4a4", "fp8"):
        q = QuantLinear(lin, fmt)
        q.calibrate_weight("four_over_six" if fmt != "fp8" else "max")
        q.calibrating = True
        q(x)
        q.calibrating = False
        p = PackedLinear(fmt, q.packed_weight(), 64, 16)
        assert torch.allclose(p(x), q(x), atol=1e-5), fmt


def test_bad_input_is_refused(model):
    with pytest.raises(ValueError, match="unknown quantization format 'int3'"):
        quant.quantize(copy.deepcopy(model), {"rules": [["*", "int3"]]})
    with pytest.raises(ValueError, match="matches no linear layer"):
        quant.quantize(copy.deepcopy(model), {"rules": [["*mixer.in_proj", "w4a16"], ["*", "w4a16"]]})
    with pytest.raises(ValueError, match="unknown calibration algorithm"):
        quant.quantize(copy.deepcopy(model), {"algorithm": "gptq", "rules": [["*", "w4a16"]]})
    with pytest.raises(ValueError, match="forward_loop"):
        quant.quantize(copy.deepcopy(model), {"rules": [["*", "w4a4"]]})
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or ±inf"):
        quant.quantize(bad, quant.AGGRESSIVE)
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantLinear(nn.Linear(24, 8), "w4a16")
    QuantLinear(nn.Linear(24, 8), "fp8")  # FP8 has no blocks: any K works
    m = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE)
    with pytest.raises(ValueError, match="already quantized"):
        quant.quantize(m, quant.AGGRESSIVE)


def test_nvfp4_bench_is_registered_and_runs_on_cpu():
    import argparse

    from minispec.bench import BENCHES

    rows = BENCHES["nvfp4"](argparse.Namespace(repeats=1))
    methods = {(r["op"], r["method"]) for r in rows}
    assert ("quantize", "torch reference") in methods and ("w4a16", "torch dequantize+matmul") in methods
    assert all(r["ms"] is not None and r["ms"] > 0 for r in rows)


def test_recovery_figure_reads_the_scorecard_schema():
    from minispec.lessons import nvfp4_qad as lesson

    metrics = ["agreement", "eval accuracy"]
    card = {"target": "t", "evaluation": {
        "ptq": {"recovery": dict(zip(metrics, [0.93, 0.97])), "median_recovery": 0.95},
        "qad": {"recovery": dict(zip(metrics, [0.99, 1.0])), "median_recovery": 0.995}}}
    ax = lesson.recovery_bars(card).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == metrics and len(ax.patches) == 4
    assert "QAD (median 99.50 %)" in [t.get_text() for t in ax.get_legend().get_texts()]
    card["evaluation"]["bf16-arith"] = {"recovery": dict(zip(metrics, [0.98, 1.0])), "median_recovery": 0.99}
    ax = lesson.recovery_bars(card).axes[0]
    assert len(ax.patches) == 6 and [p.get_height() for p in ax.patches[:2]] == [98.0, 100.0]
    assert "BF16 arithmetic (median 99.00 %)" in [t.get_text() for t in ax.get_legend().get_texts()]
