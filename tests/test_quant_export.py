"""Model Optimizer's HF NVFP4 layout: save a quantized model, reload it into packed layers, same logits."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from minispec import quant
from minispec.quant.export import load_quantized, save_quantized
from minispec.quant.modules import PackedLinear
from tiny import tiny_gemma


@pytest.fixture(scope="module")
def model():
    # BF16-representable weights, as a shipped checkpoint has: the exceptions are stored in BF16
    m = tiny_gemma(layers=2, seed=3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.bfloat16().float())
    return m


def calib(m):
    m(input_ids=torch.arange(4, 36)[None])


@pytest.mark.parametrize("recipe", [
    quant.AGGRESSIVE,
    {"name": "mixed", "algorithm": "four_over_six",
     "rules": [["*self_attn.v_proj", "bf16"], ["*self_attn*", "fp8"], ["*mlp.up_proj", "w4a4"], ["*", "w4a16"]]},
])
def test_round_trip(model, recipe, tmp_path):
    q = quant.quantize(copy.deepcopy(model), recipe, calib)
    folder = save_quantized(q, tmp_path / "q")
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    state = load_file(folder / "model.safetensors")
    assert state["lm_head.weight"].dtype == torch.uint8 and state["lm_head.weight"].shape == (4096, 32)
    assert state["lm_head.weight_scale"].dtype == torch.float8_e4m3fn
    assert state["lm_head.weight_scale"].shape == (4096, 4)
    assert state["lm_head.weight_scale_2"].dtype == torch.float32 and state["lm_head.weight_scale_2"].dim() == 0
    if recipe is quant.AGGRESSIVE:
        assert cfg["quant_algo"] == "W4A16_NVFP4" and cfg["group_size"] == 16 and cfg["exclude_modules"] == []
    else:
        layers = cfg["quantized_layers"]
        assert cfg["quant_algo"] == "MIXED_PRECISION"
        assert layers["model.layers.0.mlp.up_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
        assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
        assert "model.layers.0.self_attn.v_proj" in cfg["exclude_modules"]
        assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
        assert state["model.layers.0.mlp.up_proj.input_scale"] > 0
    back = load_quantized(folder)
    assert isinstance(back.lm_head, PackedLinear) and isinstance(back.model.layers[1].mlp.down_proj, PackedLinear)
    # the packed weights are exactly the codes and scales that were saved ...
    saved = quant.packed_state(q)
    for k, v in saved.items():
        assert torch.equal(back.state_dict()[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else
                           back.state_dict()[k].to(v.dtype), v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn
                           else v), k
    # ... and the reloaded model computes what the fake-quantized one does
    ids = torch.randint(4, 4096, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = q(input_ids=ids).logits, back(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_load_refuses_plain_and_unknown(model, tmp_path):
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no quantization_config"):
        load_quantized(tmp_path / "plain")
    q = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE)
    folder = save_quantized(q, tmp_path / "q")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["quant_algo"] = "INT4_AWQ"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported quant_algo 'INT4_AWQ'"):
        load_quantized(folder)
    with pytest.raises(ValueError, match="no quantized layer"):
        save_quantized(copy.deepcopy(model), tmp_path / "none")


def test_hybrid_moe_round_trip_writes_one_layer_per_expert(tmp_path):
    from test_quant_moe import IDS, calib

    from tiny import tiny_nemotron_h

    hf = tiny_nemotron_h()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    q = quant.quantize(copy.deepcopy(hf), quant.SUPER_TIERS, calib)
    folder = save_quantized(q, tmp_path / "q")
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    state = load_file(folder / "model.safetensors")
    assert cfg["quantized_layers"]["model.layers.2.mixer.experts.3.down_proj"] == {"quant_algo": "W4A16_NVFP4",
                                                                                   "group_size": 16}
    assert cfg["quantized_layers"]["model.layers.0.mixer.in_proj"] == {"quant_algo": "FP8"}
    assert state["model.layers.2.mixer.experts.3.down_proj.weight"].shape == (32, 8)  # [H, I / 2] codes
    assert state["model.layers.2.mixer.experts.3.down_proj.weight_scale"].shape == (32, 1)
    assert "model.layers.2.mixer.experts.up_proj" not in state
    back = load_quantized(folder)
    assert isinstance(back.model.layers[0].mixer.in_proj, PackedLinear)
    with torch.no_grad():
        assert torch.allclose(back(IDS).logits, q(IDS).logits, atol=1e-4)
