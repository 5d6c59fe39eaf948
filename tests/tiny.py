"""Tiny random models and shared checks for fast tests (tests/ is on sys.path, so `from tiny import ...`)."""
import torch
from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig, NemotronHConfig, NemotronHForCausalLM

import minispec as ms
from minispec.targets.load import CHECKPOINTS


def tiny_gemma(layers: int = 6, window: int = 16, seed: int = 0, dtype=torch.float32) -> Gemma4ForCausalLM:
    """A random Gemma-4 with bolt-mini's tokenizer ids and a 16-token sliding window."""
    torch.manual_seed(seed)
    cfg = Gemma4TextConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=32,
                           sliding_window=window, hidden_size_per_layer_input=0, vocab_size_per_layer_input=4096,
                           final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return Gemma4ForCausalLM(cfg).to(dtype).eval()


def tiny_nemotron_h(seed: int = 0, pattern: str = "M*EM-") -> NemotronHForCausalLM:
    """A random Nemotron-H hybrid (Mamba-2 "M", attention "*", MoE "E", MLP "-") with routing that does something."""
    torch.manual_seed(seed)
    cfg = NemotronHConfig(vocab_size=64, hidden_size=32, hybrid_override_pattern=pattern, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, intermediate_size=48, mamba_num_heads=4,
                          mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                          pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():  # the default init leaves the router at zero scores; give routing something to do
        for layer in model.model.layers:
            if layer.block_type == "moe":
                layer.mixer.gate.weight.normal_(0, 0.5)
    return model


def save_with_tokenizer(model, folder):
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer").save_pretrained(folder)
    return folder


def assert_same_as_ar(target, drafter, prompts, n, **kw):
    """Greedy speculative output equals autoregressive output, row by row; returns the spec result."""
    ar = ms.autoregressive_generate(target, prompts, n)
    spec = ms.speculative_generate(target, drafter, prompts, n, **kw)
    assert torch.equal(spec.lengths, ar.lengths)
    for b in range(len(prompts)):
        k = int(ar.lengths[b])
        assert spec.tokens[b, :k].tolist() == ar.tokens[b, :k].tolist(), f"row {b} differs from AR"
    return spec
