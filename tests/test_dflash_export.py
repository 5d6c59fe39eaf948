"""Export to the HF-native DFlash format (z-lab/dflash, vLLM's qwen3_dflash.py) and back; what vLLM reads from it."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

import minispec as ms
from minispec.costs import E4B_DFLASH, MiB, dflash_kv_cache_bytes, dflash_param_count
from minispec.dflash.config import FULL, SLIDING, DFlashConfig, bolt_mini_dflash_config, read_hf_config
from minispec.dflash.drafter import DFlashDrafter
from minispec.dflash.export import (
    VLLM_CONFIG_KEYS,
    VLLM_DFLASH_CONFIG_KEYS,
    config_from_hf_dflash,
    export_hf_dflash,
    load_drafter_model,
    load_hf_dflash,
)
from minispec.dflash.model import DFlashDraftModel, num_parameters
from tiny import tiny_gemma


@pytest.fixture(scope="module")
def target():
    return tiny_gemma(layers=6, window=16, seed=0)


def drafter_model(target, **kw):
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, sliding_window=12, block_size=8)
    fields.update(kw)
    torch.manual_seed(0)
    return DFlashDraftModel.for_target(DFlashConfig.for_target(target.config, [1, 3, 4], 3, **fields), target)


def read(folder):
    cfg = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return cfg, {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("own_head", [False, True])
def test_export_writes_the_hf_native_format(target, tmp_path, own_head):
    model = drafter_model(target, has_own_lm_head=own_head)
    cfg, tensors = read(export_hf_dflash(model, tmp_path))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 6 and cfg["target_hidden_size"] == 64
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3, 4], "block_size": 8,
                                    "use_swa": True, "swa_window_size": 12, "causal": False}
    assert cfg["layer_types"] == [SLIDING, SLIDING] and cfg["sliding_window"] == 12
    assert cfg["tie_word_embeddings"] is False and cfg["has_own_lm_head"] is own_head
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(2) for name in
        ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
         "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]}
    assert set(tensors) == expected | ({"lm_head.weight"} if own_head else set())  # no "model." prefix
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["layers.0.self_attn.k_norm.weight"].shape == (32,)
    assert "embed_tokens.weight" not in tensors  # the embedding is always the target's


def vllm_view(folder):
    """What vLLM's DFlash loader resolves from an exported folder, restated from its code
    (qwen3_dflash._resolve_layer_attention / _dflash_layer_causal / _get_dflash_fc_input_size and
    eagle3_utils.get_eagle3_aux_layers_from_config) on the config transformers loads."""
    config = AutoConfig.from_pretrained(folder)
    dflash = config.dflash_config
    aux = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or [i + 1 for i in dflash["target_layer_ids"]]
    layers = []
    for i in range(config.num_hidden_layers):
        any_sliding = SLIDING in (config.layer_types or [])
        if config.layer_types is None or (dflash.get("use_swa") and not any_sliding):
            sliding = dflash.get("use_swa", False)
        else:
            sliding = config.layer_types[i] == SLIDING
        window = dflash.get("swa_window_size", config.sliding_window) if sliding else None
        causal = getattr(config, "is_causal", None)
        if causal is None:
            causal = dflash.get("causal")
        if causal is None:
            causal = bool(config.layer_types) and config.layer_types[i] == SLIDING
        layers.append((window, causal))
    fc_in = len(aux) * (getattr(config, "target_hidden_size", None) or config.hidden_size)
    return config, aux, layers, fc_in


@pytest.mark.parametrize("layer_types,window", [([SLIDING, SLIDING], 12), ([SLIDING, FULL], 12), ([FULL, FULL], None)])
def test_exported_config_has_every_key_vllm_reads(target, tmp_path, layer_types, window):
    model = drafter_model(target, layer_types=layer_types, sliding_window=window)
    cfg, _ = read(export_hf_dflash(model, tmp_path))
    assert set(VLLM_CONFIG_KEYS) <= set(cfg), set(VLLM_CONFIG_KEYS) - set(cfg)
    required = set(VLLM_DFLASH_CONFIG_KEYS) - ({"swa_window_size"} if window is None else set())
    assert required <= set(cfg["dflash_config"])
    config, aux, layers, fc_in = vllm_view(tmp_path)
    assert type(config).__name__ == "Qwen3Config"
    assert aux == [2, 4, 5]  # vLLM's "input of layer i" ids = DFlash's output-of-layer ids + 1
    assert layers == [(model.config.window_of(i), False) for i in range(2)]  # windows as trained, never causal
    assert fc_in == model.fc.in_features
    assert config.dflash_config["mask_token_id"] == 3 and config.head_dim == 32 and config.vocab_size == 4096
    assert config.rope_parameters["rope_theta"] == model.config.rope_theta
    assert cfg["is_neox_style"] is True


def small_hf_config(**changes):
    """A 3-layer HF-native DFlash config.json with taps [1, 3] of a 6-layer target, stated non-causal;
    `dflash_<key>=` sets dflash_config[key], a None value removes the key."""
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8, "num_target_layers": 6,
           "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 3], "causal": False},
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 4096}
    for key, value in changes.items():
        where, key = (cfg["dflash_config"], key.removeprefix("dflash_")) if key.startswith("dflash_") else (cfg, key)
        if value is None:
            del where[key]
        else:
            where[key] = value
    return cfg


@pytest.mark.parametrize("keys,layer_types,window", [
    # The case the cost model and the importer used to read differently: use_sliding_window without
    # layer_types slides only from layer max_window_layers (28 by default) on, so none of 3 layers.
    ({"use_sliding_window": True, "sliding_window": 12}, [FULL] * 3, None),
    ({"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 0}, [SLIDING] * 3, 12),
    ({"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 2}, [FULL, FULL, SLIDING], 12),
    ({"use_sliding_window": False, "sliding_window": 12}, [FULL] * 3, None),
    # use_swa makes every layer slide when none does, with swa_window_size or else sliding_window.
    ({"use_sliding_window": True, "sliding_window": 12, "dflash_use_swa": True}, [SLIDING] * 3, 12),
    ({"dflash_use_swa": True, "dflash_swa_window_size": 10}, [SLIDING] * 3, 10),
    ({"layer_types": [SLIDING, FULL, SLIDING], "dflash_swa_window_size": 10}, [SLIDING, FULL, SLIDING], 10),
])
def test_layer_types_and_window_are_what_vllm_runs(tmp_path, keys, layer_types, window):
    """Each layer's attention type and window, read the way vLLM reads them.

    vLLM and z-lab load a DFlash config.json (model_type "qwen3") into transformers' Qwen3Config
    (huggingface/transformers, src/transformers/models/qwen3/configuration_qwen3.py), which fills a
    missing layer_types with "sliding_attention" only from layer max_window_layers (default 28) on, and
    only with use_sliding_window; z-lab/dflash dflash/model.py (Qwen3DFlashAttention) then uses those
    layer_types and sliding_window as they are. vllm-project/vllm
    vllm/model_executor/models/qwen3_dflash.py (_resolve_layer_attention) adds dflash_config.use_swa
    (every layer slides if none does) and dflash_config.swa_window_size. `vllm_view` restates that code
    on the config transformers actually loads; the cost model, the importer and the resolver must agree.
    """
    cfg = small_hf_config(**keys)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, _, vllm_layers, _ = vllm_view(tmp_path)
    expected = [(window if kind == SLIDING else None, False) for kind in layer_types]
    assert vllm_layers == expected
    resolved = read_hf_config(cfg)
    assert list(resolved.layer_types) == layer_types and resolved.sliding_window == window
    config = config_from_hf_dflash(cfg, has_lm_head=False)
    assert [(config.window_of(i), False) for i in range(3)] == expected


def test_sliding_layers_are_causal_unless_the_config_says_otherwise(tmp_path):
    """vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py (_dflash_layer_causal): the top-level
    is_causal, else dflash_config.causal, decides for every layer; when neither is given, exactly the
    sliding layers are causal (z-lab/dflash dflash/model.py has the same default). minispec's drafter is
    never causal, so it refuses such a file."""
    cfg = small_hf_config(layer_types=[SLIDING, FULL, SLIDING], dflash_swa_window_size=10, dflash_causal=None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, _, vllm_layers, _ = vllm_view(tmp_path)
    assert vllm_layers == [(10, True), (None, False), (10, True)]
    assert read_hf_config(cfg).causal == (True, False, True)
    with pytest.raises(ValueError, match=r"layers \[0, 2\] of this DFlash drafter are causal"):
        config_from_hf_dflash(cfg, has_lm_head=False)
    assert read_hf_config(small_hf_config(dflash_causal=None)).causal == (False,) * 3  # z-lab's full-attention drafters
    assert read_hf_config(small_hf_config(dflash_causal=None, is_causal=False,
                                          layer_types=[SLIDING] * 3, sliding_window=10, use_sliding_window=True)
                          ).causal == (False,) * 3
    with pytest.raises(ValueError, match="sliding layers but no window"):
        read_hf_config(small_hf_config(layer_types=[SLIDING] * 3, sliding_window=10))  # no use_sliding_window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_gives_the_same_drafter(target, tmp_path, dtype):
    model = drafter_model(target, has_own_lm_head=True, layer_types=[SLIDING, FULL])
    export_hf_dflash(model, tmp_path, dtype=dtype)
    again = load_hf_dflash(tmp_path, target)
    for field in ("target_layer_ids", "mask_token_id", "block_size", "layer_types", "sliding_window", "hidden_size",
                  "num_target_layers", "target_hidden_size", "has_own_lm_head", "final_logit_softcapping",
                  "rope_theta", "rms_norm_eps", "head_dim", "num_key_value_heads", "intermediate_size"):
        assert getattr(again.config, field) == getattr(model.config, field), field
    assert again.dtype == dtype
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor.to(dtype)), name
    if dtype == torch.float32:
        prompts = [torch.arange(30, 71), torch.arange(200, 223)]
        runs = [ms.speculative_generate(target, DFlashDrafter(m, target), prompts, 12) for m in (model, again)]
        assert [c.tokens for c in runs[0].stats.cycles] == [c.tokens for c in runs[1].stats.cycles]


def test_load_drafter_model_reads_either_format(target, tmp_path):
    model = drafter_model(target)
    model.save_pretrained(tmp_path / "minispec")
    export_hf_dflash(model, tmp_path / "hf")
    for folder in ("minispec", "hf"):
        loaded = load_drafter_model(tmp_path / folder, target)
        assert torch.equal(loaded.fc.weight, model.fc.weight)
        assert DFlashDrafter.from_pretrained(tmp_path / folder, target).block_size == 8


def test_cost_model_reads_the_export(target, tmp_path):
    model = drafter_model(target, has_own_lm_head=True)
    cfg, tensors = read(export_hf_dflash(model, tmp_path))
    shape = config_from_hf_dflash(cfg, has_lm_head="lm_head.weight" in tensors)
    assert dflash_param_count(shape).total == num_parameters(model) == sum(t.numel() for t in tensors.values())
    assert shape.sliding_window == 12 and shape.num_taps == 3 and shape.block_size == 8


# Bolt E4B's drafter config.json as published with "Nemotron 3.5 Bolt E4B: block-parallel speculation with DFlash".
E4B_CONFIG = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
    "dflash_config": {"mask_token_id": 4, "target_layer_ids": [5, 11, 17, 23, 35], "use_swa": True,
                      "swa_window_size": 1024, "causal": False},
    "hidden_size": 2560, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 5120, "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 262144,
    "max_position_embeddings": 131072, "rope_theta": 1000000, "num_target_layers": 42,
    "layer_types": [SLIDING] * 5, "sliding_window": 1024, "has_own_lm_head": True, "tie_word_embeddings": False,
    "final_logit_softcapping": 30.0,
}


def test_e4b_config_builds_a_drafter_of_the_published_size(tmp_path):
    config = config_from_hf_dflash(E4B_CONFIG, has_lm_head=True)
    assert config.target_layer_ids == [5, 11, 17, 23, 35] and config.window_of(4) == 1024
    with torch.device("meta"):  # shapes only: no 4 GB of weights on a laptop
        model = DFlashDraftModel(config)
    assert num_parameters(model) == 1_031_568_640 == dflash_param_count(E4B_DFLASH).total
    assert model.lm_head.weight.numel() / num_parameters(model) == pytest.approx(0.651, abs=5e-4)
    from minispec.dflash.export import hf_dflash_config

    exported = hf_dflash_config(config, torch.bfloat16)
    assert dflash_kv_cache_bytes(config_from_hf_dflash(exported, has_lm_head=True)) == 20 * MiB
    for key in ("block_size", "num_target_layers", "layer_types", "sliding_window", "has_own_lm_head"):
        assert exported[key] == E4B_CONFIG[key], key
    assert exported["dflash_config"] == {**E4B_CONFIG["dflash_config"], "block_size": 8}


def test_bolt_mini_drafter_exports(tmp_path):
    from minispec.targets.configs import bolt_mini_config

    target_config = bolt_mini_config()
    cfg = bolt_mini_dflash_config()
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    from minispec.dflash.export import hf_dflash_config

    exported = hf_dflash_config(cfg)
    assert exported["dflash_config"]["target_layer_ids"] == [5, 8, 10]
    assert exported["num_target_layers"] == target_config.num_hidden_layers
    shape = config_from_hf_dflash(exported, has_lm_head=False)
    assert dflash_param_count(shape).total == num_parameters(model)


def test_bad_files_say_what_is_wrong(target, tmp_path):
    def broken(**changes):
        cfg = json.loads(json.dumps(E4B_CONFIG))
        for key, value in changes.items():
            if key.startswith("dflash_"):
                cfg["dflash_config"][key.removeprefix("dflash_")] = value
            else:
                cfg[key] = value
        return cfg

    with pytest.raises(ValueError, match="block_size 8 at the top level but 16 in dflash_config"):
        config_from_hf_dflash(broken(dflash_block_size=16), True)
    with pytest.raises(ValueError, match="no target_layer_ids; they are never recomputed"):
        config_from_hf_dflash(broken(dflash_target_layer_ids=None), True)
    with pytest.raises(ValueError, match=r"target_layer_ids \[41\] out of range for a 42-layer target"):
        config_from_hf_dflash(broken(dflash_target_layer_ids=[5, 41]), True)
    with pytest.raises(ValueError, match="causal"):
        config_from_hf_dflash(broken(dflash_causal=True), True)
    with pytest.raises(ValueError, match="not a DFlash drafter config"):
        config_from_hf_dflash(broken(architectures=["Qwen3ForCausalLM"]), True)
    with pytest.raises(ValueError, match="needs mask_token_id"):
        config_from_hf_dflash(broken(dflash_mask_token_id=None), True)

    model = drafter_model(target)
    folder = export_hf_dflash(model, tmp_path / "ok")
    cfg = json.loads((folder / "config.json").read_text())
    # vLLM-style ids (input of layer i) are accepted and converted.
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    assert config_from_hf_dflash(cfg, False).target_layer_ids == [1, 3, 4]

    cfg["dflash_config"]["target_layer_ids"] = [0, 3, 4]
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[2, 4, 5\] .* disagree"):
        config_from_hf_dflash(cfg, False)
    del cfg["dflash_config"]["target_layer_ids"]

    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4]  # two taps, but fc was trained on three
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"fc.weight is \(64, 192\) but the config's 2 taps"):
        load_hf_dflash(folder, target)

    from safetensors.torch import save_file

    folder = export_hf_dflash(model, tmp_path / "extra")
    _, tensors = read(folder)
    save_file({**tensors, "embed_tokens.weight": torch.zeros(4096, 64)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="own embed_tokens.weight"):
        load_hf_dflash(folder, target)
    del tensors["norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        load_hf_dflash(folder, target)
