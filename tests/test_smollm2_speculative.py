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
