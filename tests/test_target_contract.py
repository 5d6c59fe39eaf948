"""One target contract: every model `ms.load_target` returns decodes by both loops, greedy speculative output
equal to autoregressive output; what the speculative loop cannot roll back is refused before any work."""
import pytest
import torch
from transformers import AutoModelForCausalLM, JambaConfig, LlamaConfig

import minispec as ms
from minispec.speculative.target import HFTarget, target_adapter
from minispec.ssm.hybrid import HybridLM, HybridTarget
from tiny import save_with_tokenizer

SHIPPED = ["bolt-mini", "bolt-nano", "lightning-mini"]


def assert_both_loops_agree(model, prompt, n: int = 12):
    """Greedy AR and speculative decoding (n-gram drafts) give the same tokens, ids within the vocabulary."""
    ar = ms.autoregressive_generate(model, prompt, n)
    spec = ms.speculative_generate(model, ms.load_drafter("ngram", model), prompt, n)
    assert torch.equal(spec.lengths, ar.lengths) and 1 <= int(ar.lengths[0]) <= n
    k = int(ar.lengths[0])
    assert torch.equal(spec.tokens[0, :k], ar.tokens[0, :k])
    assert 0 <= int(ar.tokens.min()) and int(ar.tokens.max()) < model.config.vocab_size
    return ar


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_targets_decode_by_both_loops(name):
    model, _ = ms.load_target(name)
    assert_both_loops_agree(model, ms.load_evalset().prompts[0][-48:])


@pytest.mark.slow
def test_the_real_target_decodes_by_both_loops(smollm2):
    model, tok = smollm2
    assert_both_loops_agree(model, ms.load_mtbench(tok).prompts[0], n=8)


def test_lightning_mini_as_loaded_is_driven_as_the_hybrid_lm_sharing_its_weights():
    hf, _ = ms.load_target("lightning-mini")
    assert type(hf).__name__ == "NemotronHForCausalLM"
    adapter = target_adapter(hf)
    assert isinstance(adapter, HybridTarget)
    assert adapter.model.lm_head.weight.data_ptr() == hf.lm_head.weight.data_ptr()  # shared, not copied
    prompt = ms.load_evalset().prompts[1][-40:]
    from_hf = assert_both_loops_agree(hf, prompt)
    assert torch.equal(from_hf.tokens, ms.autoregressive_generate(HybridLM.from_pretrained("lightning-mini"),
                                                                  prompt, 12).tokens)
    # The MTP head shipped beside its weights reads the hidden states the HybridLM adapter gives.
    with_mtp = ms.speculative_generate(hf, ms.load_drafter("mtp", hf), prompt, 12)
    assert torch.equal(with_mtp.tokens, from_hf.tokens) and with_mtp.stats.tau > 1


@pytest.mark.parametrize("loaded", ["hf", "hybrid"])
def test_a_hybrid_target_refuses_a_speculative_batch_before_any_work(loaded):
    hf, _ = ms.load_target("lightning-mini")
    model = hf if loaded == "hf" else HybridLM.from_hf(hf)
    seen = []
    with pytest.raises(ValueError, match="runs one unpadded sequence at a time, got a batch of 2: call it once per"):
        ms.speculative_generate(model, ms.load_drafter("ngram", model), ms.load_evalset().prompts[:2], 8,
                                on_cycle=seen.append)
    assert seen == []


def tiny_jamba():
    """A random Jamba (Mamba + attention): transformers' cache keeps its Mamba state, which cannot be cut back."""
    torch.manual_seed(0)
    cfg = JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                      expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_a_cache_that_cannot_roll_back_is_refused_for_speculation_and_decodes_autoregressively():
    model = tiny_jamba()
    assert isinstance(target_adapter(model), HFTarget)
    ar = ms.autoregressive_generate(model, [5, 6, 7, 8], 6)
    theirs = model.generate(torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                            max_new_tokens=6, do_sample=False)[0, 4:]
    assert ar.tokens[0].tolist() == theirs.tolist()
    with pytest.raises(ValueError, match=r"cannot roll back JambaForCausalLM: its cache has LinearAttentionLayer "
                                         r"layers.*decode it with autoregressive_generate"):
        ms.speculative_generate(model, ms.load_drafter("ngram", model), [5, 6, 7, 8], 6)


def test_any_local_hf_causal_lm_folder_decodes_by_both_loops(tmp_path):
    """A tiny random Llama saved as a plain hub-style folder, with bolt-mini's tokenizer beside it."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2)
    folder = save_with_tokenizer(AutoModelForCausalLM.from_config(cfg), tmp_path / "llama")
    model, _ = ms.load_target(folder)
    assert_both_loops_agree(model, torch.tensor([5, 6, 7, 5, 6, 7, 5, 6]), n=20)
    with pytest.raises(ValueError, match="prompt of 8 tokens \\+ max_new_tokens 57 = 65 positions, but the model "
                                         "has 64"):
        ms.autoregressive_generate(model, torch.tensor([5, 6, 7, 5, 6, 7, 5, 6]), 57)


def test_the_demo_and_the_speculative_bench_run_lightning_mini(tmp_path, capsys):
    import json

    from minispec.__main__ import main as demo
    from minispec.bench import main as bench

    demo(["demo", "--target", "lightning-mini", "--max-new-tokens", "8", "--threads", str(torch.get_num_threads())])
    assert "greedy speculative output equals autoregressive output" in capsys.readouterr().out
    bench(["spec", "--target", "lightning-mini", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "8",
           "--drafters", "ngram", "--json", str(tmp_path / "spec.json")])
    rows = json.loads((tmp_path / "spec.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["autoregressive", "speculative"] and rows[1]["tau"] >= 1
