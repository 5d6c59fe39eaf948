"""The speculative loop on the real target: greedy output equals autoregressive output with the n-gram
drafter and the shipped DFlash drafter, and the shipped drafter survives an export round trip."""
import json

import pytest
import torch

import minispec as ms
from minispec.dflash.export import export_hf_dflash, load_drafter_model
from minispec.targets.load import CHECKPOINTS
from tiny import assert_same_as_ar

pytestmark = pytest.mark.slow
DRAFTER = "smollm2-135m-dflash"


@pytest.fixture(scope="module")
def questions(smollm2):
    """Two short MT-Bench first turns (a math and a coding question), with the chat template."""
    bench = ms.load_mtbench(smollm2[1])
    picked = [bench.categories.index("math"), bench.categories.index("coding")]
    return [bench.prompts[i] for i in picked]


@pytest.mark.parametrize("drafter_name", ["ngram", DRAFTER])
def test_greedy_speculative_equals_autoregressive(smollm2, questions, drafter_name):
    model, _ = smollm2
    drafter = ms.load_drafter(drafter_name, model)
    spec = assert_same_as_ar(model, drafter, questions, 24)
    assert spec.stats.tau >= 1.0


def test_shipped_drafter_config_fits_the_target(smollm2):
    model, _ = smollm2
    drafter = ms.load_drafter(DRAFTER, model)
    cfg = drafter.model.config
    assert cfg.target_layer_ids == [1, 7, 14, 20, 27] and cfg.num_target_layers == 30
    assert cfg.block_size == 8 and drafter.num_draft_tokens == 7
    record = json.loads((CHECKPOINTS / DRAFTER / "training.json").read_text())
    assert record["settings"]["draft_vocab"] == cfg.draft_vocab_size
    assert 2 in drafter.model.draft_vocab().tolist()  # EOS can be drafted: replies end with it


def test_shipped_drafter_export_round_trip(smollm2, questions, tmp_path):
    """The HF-native export (what vLLM and z-lab read) holds the same tensors and drafts the same tokens."""
    model, _ = smollm2
    shipped = ms.load_drafter(DRAFTER, model)
    export_hf_dflash(shipped.model, tmp_path)
    loaded = load_drafter_model(tmp_path, model)
    for name, tensor in shipped.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name].to(tensor.dtype), tensor), name
    again = ms.load_drafter(tmp_path, model)
    a = ms.speculative_generate(model, shipped, questions[:1], 16)
    b = ms.speculative_generate(model, again, questions[:1], 16)
    assert torch.equal(a.tokens, b.tokens)
    assert [c.accepted for c in a.stats.cycles] == [c.accepted for c in b.stats.cycles]


def test_the_walk_through_a_greedy_reply_counts_the_loops_cycles(smollm2, questions):
    """`train.walk_replies` (the held-out loop tau) reads a block at every position of a greedy reply and walks
    it as the loop would: it must count the cycles the real loop runs over that reply."""
    from types import SimpleNamespace

    from minispec.dflash.train import SETTINGS, walk_replies

    model, _ = smollm2
    drafter = ms.load_drafter(DRAFTER, model)
    for prompt in questions:
        spec = ms.speculative_generate(model, drafter, [prompt], 40)
        reply = spec.tokens[0, : 40]
        x = torch.cat([torch.as_tensor(prompt), reply])[None]
        loss_mask = torch.zeros_like(x)
        loss_mask[0, len(prompt):] = 1
        with torch.no_grad():
            features = drafter.model.tap(model(input_ids=x, output_hidden_states=True).hidden_states)
        b = SimpleNamespace(input_ids=x, loss_mask=loss_mask, features=features)
        tokens, cycles = walk_replies(drafter.model, b, [0], SETTINGS["smollm2-135m"])
        loop = [c for c in spec.stats.cycles if c.cycle > 0]
        assert (tokens, cycles) == (sum(len(c.emitted) for c in loop), len(loop))
        assert any(c.accepted > 0 for c in loop)  # the walk has drafts to follow, not only corrections
