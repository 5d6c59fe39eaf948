import pytest
import torch
from transformers import AutoTokenizer

from minispec.targets import corpus
from minispec.targets.evalset import CONTINUATION, MAX_PROMPT, MIN_PROMPT, load_evalset
from minispec.targets.load import CHECKPOINTS


def test_split_is_a_stable_hash_of_the_path():
    # Values fixed when the split was designed: changing the hash or the percentages breaks them.
    assert [corpus.split_of(p) for p in ["json/decoder.py", "asyncio/tasks.py", "collections/__init__.py"]] == [
        "train", "val", "test"]


def test_splits_are_disjoint_and_sized():
    names = {s: {f.relpath for f in corpus.iter_files(s)} for s in corpus.SPLITS}
    assert not names["train"] & names["val"] and not names["train"] & names["test"] and not names["val"] & names["test"]
    total = sum(len(n) for n in names.values())
    assert total > 500
    # 90 / 5 / 5 percent of files, within binomial noise (4 sigma).
    for split, pct in corpus.SPLIT_PERCENT.items():
        expected = total * pct / 100
        assert abs(len(names[split]) - expected) < 4 * (total * pct / 100 * (1 - pct / 100)) ** 0.5


def test_unknown_split():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        corpus.iter_files("dev")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer")


def test_tokenizer_special_tokens(tok):
    assert tok.vocab_size == 4096
    assert [tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.mask_token_id] == [0, 1, 2, 3]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<eos>", "<bos>", "<mask>"]


def test_tokenizer_round_trips_code_exactly(tok):
    text = "def f(x):\n\treturn {'ü': x ** 2}  # ∑ ok\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    sample = corpus.iter_files("test")[0].text[:5000]
    ids = tok(sample)["input_ids"]
    assert tok.decode(ids) == sample
    assert len(sample) / len(ids) > 2.5  # BPE compresses code: about 3.4 characters per token


def test_frozen_evalset():
    es = load_evalset()
    assert 200 <= len(es) <= 400
    lengths = torch.tensor([len(p) for p in es.prompts])
    assert int(lengths.min()) >= MIN_PROMPT and int(lengths.max()) <= MAX_PROMPT
    assert es.continuations.shape == (len(es), CONTINUATION)
    assert all(0 <= int(p.min()) and int(p.max()) < 4096 for p in es.prompts)
    assert len(set(es.files)) > 50  # prompts come from many held-out files
    assert not set(es.files) & {f.relpath for f in corpus.iter_files("train")}


@pytest.mark.parametrize("name", ["bolt-mini", "bolt-nano"])
def test_recorded_eval_scores_are_reproduced(name):
    """docs/models.md quotes each model's eval.json; the shipped weights must still give its numbers."""
    import json

    import minispec as ms
    from minispec.targets.evalset import score

    recorded = json.loads((CHECKPOINTS / name / "eval.json").read_text())
    assert recorded["tokens"] == CONTINUATION * len(load_evalset())  # recorded over the whole set
    got = score(ms.load_target(name)[0], limit=40)
    assert got["loss"] == pytest.approx(recorded["first_40"]["loss"], rel=1e-4)
    assert got["accuracy"] == pytest.approx(recorded["first_40"]["accuracy"], abs=1e-3)
