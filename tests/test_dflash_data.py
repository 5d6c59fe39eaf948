"""The drafter's ShareGPT data: the tolerant reader, the plan's filters, resumable shards, the committed set."""
import json
from pathlib import Path

import numpy as np
import pytest

from minispec.dflash import data
from minispec.targets import mtbench, sharegpt

SHIPPED = data.DATASETS / "smollm2-135m-sharegpt"


def conversation(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def mtbench_turns() -> list[str]:
    rows = [json.loads(r) for r in mtbench.questions_path().read_text().splitlines() if r.strip()]
    return [t for r in rows for t in r["turns"]]


def write_truncated(path: Path, conversations: list[dict]) -> Path:
    """The conversations as a JSON array, then one more element cut off inside a string, as in the wheel."""
    text = json.dumps(conversations, indent=2)[:-2] + ',\n  {"id": "cut", "conversations": [{"from": "human", "va'
    path.write_text(text)
    return path


def test_reader_keeps_every_complete_conversation_of_a_truncated_file(tmp_path):
    items = [conversation(f"c{i}", ("human", f"question {i}"), ("gpt", "answer")) for i in range(5)]
    path = write_truncated(tmp_path / "cut.json", items)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    got = sharegpt.read_conversations(path)
    assert got.items == items and got.truncated == 1
    (tmp_path / "whole.json").write_text(json.dumps(items))
    whole = sharegpt.read_conversations(tmp_path / "whole.json")
    assert whole.items == items and whole.truncated == 0
    (tmp_path / "object.json").write_text('{"id": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        sharegpt.read_conversations(tmp_path / "object.json")


def test_chat_turns_maps_speakers_and_names_what_is_wrong():
    ok = conversation("a", ("system", "Be brief."), ("human", "Hi"), ("chatgpt", "Hello"), ("human", "Bye"))
    assert [m["role"] for m in sharegpt.chat_turns(ok)] == ["system", "user", "assistant", "user"]
    later_part = conversation("b_1", ("gpt", "...the end of a reply"), ("human", "Thanks! And next?"))
    assert sharegpt.chat_turns(later_part) == [{"role": "user", "content": "Thanks! And next?"}]
    assert sharegpt.chat_turns(conversation("c", ("human", "Hi"), ("human", "Hi again"))) == "broken"
    assert sharegpt.chat_turns(conversation("d", ("human", "Hi"), ("robot", "beep"))) == "broken"
    assert sharegpt.chat_turns(conversation("e", ("human", "  "), ("gpt", "?"))) == "empty"
    assert sharegpt.chat_turns(conversation("f", ("gpt", "only a reply"))) == "empty"


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def test_plan_drops_and_counts_every_kind_of_bad_conversation(tokenizer):
    bench = mtbench_turns()
    s = data.Settings(max_prompt=96, heldout_every=3)
    good = [conversation(f"g{i}", ("human", f"How do I water plant number {i}?"), ("gpt", "Daily."),
                         ("human", "And in winter?")) for i in range(12)]
    bad = [conversation("broken", ("human", "a"), ("human", "b")),
           conversation("empty", ("human", "")),
           conversation("latin", ("human", "请用中文回答这个问题，谢谢你的帮助")),
           conversation("copied", ("human", "Please help: " + bench[0])),
           conversation("long", ("human", "word " * 200)),
           conversation("long-later", ("human", "Short question?"), ("gpt", "word " * 200), ("human", "More?"))]
    samples, counts = data.plan(tokenizer, good + bad, bench, s)
    assert {k: counts[k] for k in ("broken", "empty", "non_latin", "mtbench", "overlong", "overlong_turns")} == \
        {"broken": 1, "empty": 1, "non_latin": 1, "mtbench": 1, "overlong": 1, "overlong_turns": 1}
    keys = {x.key for split in samples.values() for x in split}
    assert not any(k.startswith(("broken", "empty", "latin", "copied", "long:")) for k in keys)
    held = {k.split(":")[0] for k in (x.key for x in samples["heldout"])}
    train = {k.split(":")[0] for k in (x.key for x in samples["train"])}
    assert held and train and not held & train
    assert all(x.key.endswith(":0") for x in samples["heldout"])  # held-out: first turns only
    first_depth = [x.key.endswith(":0") for x in samples["train"]]
    assert first_depth == sorted(first_depth, reverse=True)  # every first turn before any second turn
    second = next(x for x in samples["train"] if x.key.endswith(":1"))
    assert "Daily." in tokenizer.decode(second.prompt)  # a later turn carries the real history
    assert all(len(x.prompt) <= s.max_prompt for x in samples["train"])


def test_the_mtbench_rule_drops_a_paraphrase_that_keeps_ten_words_and_keeps_a_topic_match():
    bench = mtbench_turns()
    banned = set().union(*(data.ngrams(t, 10) for t in bench))
    words = data.words(bench[0])
    assert data.ngrams("Could you: " + " ".join(words[:10]) + " please", 10) & banned
    assert not data.ngrams("Write a travel blog post about a trip to Hawaii.", 10) & banned


@pytest.mark.slow
def test_shards_resume_and_are_never_generated_twice(tmp_path, monkeypatch):
    items = [conversation(f"q{i + 4}", ("human", f"Name a fruit that starts with the letter {c}.")) for i, c in
             enumerate("ABCDEFGHIJKL")]
    source = write_truncated(tmp_path / "sharegpt.json", items)
    out = tmp_path / "set"
    args = ["--sharegpt", str(source), "--out", str(out), "--shard-size", "3", "--reply-len", "4",
            "--heldout-shards", "1", "--heldout-every", "4", "--batch-size", "2"]
    data.main(args + ["--reply-tokens", "1"])
    first = sorted(p.name for p in out.glob("*.npz"))
    assert first == ["heldout-00000.npz", "train-00000.npz"]
    before = {p.name: p.read_bytes() for p in out.glob("*.npz")}

    made = []
    real = data.generate_shard
    monkeypatch.setattr(data, "generate_shard", lambda *a, **k: made.append(a[2]) or real(*a, **k))
    data.main(args + ["--reply-tokens", "1"])
    assert made == []  # nothing left to do: no shard is generated again
    shard0 = json.loads((out / "dataset.json").read_text())["shards"]["train-00000.npz"]["reply_tokens"]
    data.main(args + ["--reply-tokens", str(shard0 + 1)])
    assert made == [3]  # only the next train shard (samples 3..5)
    assert {p.name: p.read_bytes() for p in out.glob("*.npz") if p.name in before} == before
    manifest = json.loads((out / "dataset.json").read_text())
    assert set(manifest["shards"]) == {"heldout-00000.npz", "train-00000.npz", "train-00001.npz"}
    assert manifest["counts"]["truncated"] == 1 and manifest["counts"]["conversations"] == 12

    replies = data.load_replies(out, "train", pad_id=0)
    assert len(replies) == 6 and int(replies.loss_mask.sum()) == sum(
        v["reply_tokens"] for k, v in manifest["shards"].items() if k.startswith("train"))
    with pytest.raises(ValueError, match="other settings"):
        data.main(args[:-2] + ["--batch-size", "3", "--reply-tokens", "1"])


def test_the_committed_set_is_what_its_manifest_says_and_never_saw_mtbench():
    manifest = json.loads((SHIPPED / "dataset.json").read_text())
    bench = set().union(*(data.ngrams(t, manifest["settings"]["ngram"]) for t in mtbench_turns()))
    from transformers import AutoTokenizer

    from minispec.targets.smollm2 import converted_folder

    tok = AutoTokenizer.from_pretrained(converted_folder())
    train_keys, held_keys = set(), set()
    for name, record in manifest["shards"].items():
        shard = data.read_shard(SHIPPED / name)
        assert shard["tokens"].dtype == np.uint16
        assert int(shard["reply_lengths"].sum()) == record["reply_tokens"]
        assert len(shard["tokens"]) == record["reply_tokens"] + record["prompt_tokens"]
        assert (shard["reply_lengths"] <= manifest["settings"]["reply_len"]).all()
        sampled = shard["temperatures"] == 1.0
        assert 0.15 < sampled.mean() < 0.35  # every fourth sample at T = 1
        (held_keys if name.startswith("heldout") else train_keys).update(
            k.split(":")[0] for k in shard["keys"].tolist())
        ends = np.cumsum(shard["prompt_lengths"] + shard["reply_lengths"])
        for row, P in zip(np.split(shard["tokens"], ends[:-1]), shard["prompt_lengths"]):
            assert not data.ngrams(tok.decode(row[:P].tolist()), manifest["settings"]["ngram"]) & bench
    assert train_keys and held_keys and not train_keys & held_keys
