"""lightning-mini: minispec's own Nemotron-H hybrid forward vs transformers, and exact speculative
decoding over it with both Mamba state strategies."""
import pytest
import torch

import minispec as ms
from minispec.ssm.hybrid import HybridLM
from tiny import tiny_nemotron_h

PATTERN = "M*EM-"


@pytest.fixture(scope="module")
def shipped():
    hf, tok = ms.load_target("lightning-mini")
    return hf, HybridLM.from_hf(hf), tok


def test_same_weights_same_logits_tiny():
    hf = tiny_nemotron_h()
    model = HybridLM.from_hf(hf)
    assert model.pattern == PATTERN
    ids = torch.randint(3, 64, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = model(ids)
    assert (out.logits - ref).abs().max() < 1e-4
    # the trunk API (for MTP heads): pre- and post-final-norm hidden states, shared embedding and head
    assert torch.allclose(model.lm_head(out.hidden).float(), out.logits)
    assert torch.allclose(model.model.norm_f(out.hidden_pre_norm), out.hidden)
    assert model.embed_tokens is model.model.embeddings


@pytest.mark.parametrize("strategy", ["replay", "per-position"])
def test_cached_decoding_equals_the_full_forward_tiny(strategy):
    model = HybridLM.from_hf(tiny_nemotron_h())
    ids = torch.randint(3, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(1, strategy, capacity=4)
        parts = [model(ids[:, :12], cache).logits]
        parts.append(model(ids[:, 12:15], cache, commit=False).logits)  # a window of 3, keep 2
        cache.commit(2)
        parts[-1] = parts[-1][:, :2]
        for t in range(14, 30):
            parts.append(model(ids[:, t:t + 1], cache).logits)
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-4
    model(ids[:, :2], cache, commit=False)
    with pytest.raises(ValueError, match="uncommitted"):
        model(ids[:, :2], cache)
    with pytest.raises(ValueError, match="left 2 pending"):
        cache.commit(3)


def test_shipped_model_loads_in_transformers_with_the_same_logits(shipped):
    hf, model, tok = shipped
    assert type(hf).__name__ == "NemotronHForCausalLM" and tok.vocab_size == 4096
    assert model.pattern == "MEM*M-ME"
    n_params = sum(p.numel() for p in hf.parameters())
    assert 3e6 <= n_params <= 6e6
    prompt = ms.load_evalset().prompts[0][None]
    with torch.no_grad():
        ref = hf(input_ids=prompt).logits
        out = model(prompt).logits
    assert (out - ref).abs().max() < 1e-3
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_shipped_greedy_generation_equals_transformers(shipped):
    hf, model, _ = shipped
    for prompt in ms.load_evalset().prompts[:2]:
        ours = ms.autoregressive_generate(model, prompt, 32).tokens
        theirs = hf.generate(prompt[None], max_new_tokens=32, do_sample=False)[:, prompt.numel():]
        assert torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def autoregressive(shipped):
    _, model, _ = shipped
    prompt = ms.load_evalset().prompts[5][None]
    ar = {}
    try:
        for strategy in ("replay", "per-position"):
            model.spec_strategy = strategy
            ar[strategy] = ms.autoregressive_generate(model, prompt, 40).tokens
    finally:
        model.spec_strategy = "replay"
    assert torch.equal(ar["replay"], ar["per-position"])
    return prompt, ar["replay"]


@pytest.mark.parametrize("strategy", ["replay", "per-position"])
@pytest.mark.parametrize("drafter_name", ["ngram", "bolt-nano"])
def test_speculative_equals_autoregressive_on_lightning_mini(shipped, autoregressive, strategy, drafter_name):
    _, model, _ = shipped
    prompt, ar = autoregressive
    model.spec_strategy = strategy
    try:
        spec = ms.speculative_generate(model, ms.load_drafter(drafter_name, model, num_draft_tokens=4), prompt, 40)
    finally:
        model.spec_strategy = "replay"
    assert torch.equal(spec.tokens, ar)
    cycles = spec.stats.verifications
    assert any(c.accepted < 4 for c in cycles) and any(c.accepted > 0 for c in cycles)  # rollbacks and accepts
    if strategy == "replay":
        assert all(store.flushes >= 1 for store in model.last_target.cache.mamba.values())


def test_speculative_refuses_a_batch(shipped):
    _, model, _ = shipped
    prompts = ms.load_evalset().prompts[:2]
    with pytest.raises(ValueError, match="one unpadded sequence"):
        ms.speculative_generate(model, ms.load_drafter("ngram", model), prompts, 8)


def test_from_pretrained_reads_the_hub_layout(shipped):
    from safetensors import safe_open

    from minispec.targets.load import resolve
    with safe_open(resolve("lightning-mini") / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "backbone.layers.1.mixer.experts.3.up_proj.weight" in keys  # NVIDIA's on-disk names
    _, model, _ = shipped
    loaded = HybridLM.from_pretrained("lightning-mini")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_recorded_eval_scores_are_reproduced(shipped):
    """docs/models.md quotes lightning-mini's eval.json; the shipped weights must still give its numbers."""
    import json

    from minispec.targets.evalset import score
    from minispec.targets.load import resolve
    recorded = json.loads((resolve("lightning-mini") / "eval.json").read_text())["first_40"]
    got = score(shipped[0], limit=40)
    assert got["loss"] == pytest.approx(recorded["loss"], rel=1e-4)
    assert got["accuracy"] == pytest.approx(recorded["accuracy"], abs=1e-3)


def test_bench_replay_cli(tmp_path, capsys):
    import json

    from minispec.bench import main
    out = tmp_path / "replay.json"
    main(["replay", "--prompts", "1", "--max-new-tokens", "6", "--repeats", "1", "--drafters", "ngram",
          "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    speed = [r for r in rows if r["kind"] == "speed"]
    assert len([r for r in rows if r["kind"] == "bytes"]) == 6 and len(speed) == 4
    assert all(r["equal_to_ar"] is True for r in speed)
    assert "write_ratio" in capsys.readouterr().out
