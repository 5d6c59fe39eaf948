"""The drafters' training prompts: seeded stdlib requests from one split, seed tasks that are not MT-Bench."""
import re

import pytest

import minispec as ms
from minispec.targets import corpus, instructions


def fake_split(split, root=None):
    """A stand-in split of one file whose 8 documented functions name their split."""
    body = "".join(f'def {split}_fn_{i}():\n    """Return {split}_fn_{i} as a number, for the test."""\n'
                   for i in range(8))
    return [corpus.SourceFile(f"{split}.py", body)]


def test_stdlib_requests_are_seeded_and_use_only_the_split_asked_for(monkeypatch):
    monkeypatch.setattr(corpus, "iter_files", fake_split)
    requests = instructions.stdlib_requests(6, seed=0, split="val")
    assert instructions.stdlib_requests(6, seed=0, split="val") == requests
    assert instructions.stdlib_requests(6, seed=1, split="val") != requests
    assert all("val_fn_" in r and "train_fn_" not in r for r in requests)
    with pytest.raises(ValueError, match="asked for 9 stdlib requests but the val split has 8"):
        instructions.stdlib_requests(9, seed=0, split="val")


@pytest.mark.slow
def test_stdlib_requests_from_the_real_val_split():
    requests = instructions.stdlib_requests(6, seed=0, split="val")
    assert len(set(requests)) == 6
    assert requests[0].startswith("Write a Python function `") and "```python" in requests[1]
    assert requests[2].startswith("Summarize this documentation")


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def eight_grams(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + 8]) for i in range(len(w) - 7)}


def test_seed_tasks_share_nothing_with_mt_bench(smollm2):
    questions = ms.load_mtbench(smollm2[1]).questions
    tasks = [t for category in instructions.SEED_TASKS.values() for t in category]
    for task in tasks:
        for question in questions:
            assert " ".join(words(question)) not in " ".join(words(task)), task
            assert " ".join(words(task)) not in " ".join(words(question)), task
            assert not eight_grams(task) & eight_grams(question), (task, question)


@pytest.mark.slow
def test_self_instruct_is_seeded(smollm2):
    model, tokenizer = smollm2
    tasks = instructions.self_instruct(model, tokenizer, 2, seed=0, batch_size=2, max_len=4)
    assert len(tasks) == 2 and all(isinstance(t, str) and t for t in tasks)
    assert instructions.self_instruct(model, tokenizer, 2, seed=0, batch_size=2, max_len=4) == tasks
