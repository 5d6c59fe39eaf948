"""The drafters' training prompts: seeded stdlib requests from one split, seed tasks that are not MT-Bench."""
import re

import pytest
import torch

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
    with pytest.raises(ValueError, match=r"asked for stdlib requests 0\.\.9 but the val split has 8"):
        instructions.stdlib_requests(9, seed=0, split="val")


def test_consecutive_offsets_never_repeat_a_request(monkeypatch):
    monkeypatch.setattr(corpus, "iter_files", fake_split)
    parts = [instructions.stdlib_requests(2, seed=3, split="val", offset=2 * i) for i in range(4)]
    names = [re.search(r"val_fn_\d", r).group() for part in parts for r in part]
    assert sorted(names) == [f"val_fn_{i}" for i in range(8)]
    with pytest.raises(ValueError, match=r"requests 8\.\.10 but the val split has 8"):
        instructions.stdlib_requests(2, seed=3, split="val", offset=8)


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


def test_instruction_replies_are_made_and_cached_in_parts(monkeypatch, tmp_path):
    """A larger `num` reuses the parts already made; each part has its own prompts and seed."""
    from minispec.targets import replies as replies_module

    made = []

    def fake_prompts(model, tokenizer, num, seed, split, part):
        made.append(part)
        return [torch.tensor([100 * part + i] * (1 + i % 3)) for i in range(num)]

    def fake_replies_to(model, prompts, reply_len, temperature, seed, batch_size):
        width = max(len(p) for p in prompts) + reply_len
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p
            ids[i, len(p):len(p) + reply_len] = seed
        return replies_module.Replies(ids, (ids == seed).long())

    monkeypatch.setattr(instructions, "training_prompts", fake_prompts)
    monkeypatch.setattr(replies_module, "replies_to", fake_replies_to)
    monkeypatch.setattr(replies_module, "replies_dir", lambda: tmp_path)
    monkeypatch.setattr(replies_module, "special_ids", lambda model: (0, 1))
    model = torch.nn.Linear(2, 2)
    first = replies_module.instruction_replies(model, None, 5, 2, seed=7, part_size=4)
    assert made == [0, 1] and len(first) == 5
    second = replies_module.instruction_replies(model, None, 10, 2, seed=7, part_size=4)
    assert made == [0, 1, 2] and len(second) == 10
    assert torch.equal(second.input_ids[:4, :first.input_ids.shape[1]], first.input_ids[:4])
    assert set(second.input_ids[:, 0].tolist()) >= {0, 100, 200}  # each part's own prompts
    assert {int(r[m.bool()][0]) for r, m in zip(second.input_ids, second.loss_mask)} == {
        7 * 1_000_003 + part for part in range(3)}
    with pytest.raises(ValueError, match="part_size must be >= 1"):
        replies_module.instruction_replies(model, None, 5, 2, part_size=0)
