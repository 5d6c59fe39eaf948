"""Instruction prompts for a chat target, built on this machine: the training prompts of its drafters.

A drafter is trained on the target's own replies (`minispec.targets.replies`), so what matters is
that the prompts ask for the kinds of answers the target will later write. MT-Bench is evaluation
only, so the prompts come from two sources that never touch it:

* **the standard library** (`stdlib_requests`): every documented function or class of the corpus'
  train split becomes a request: write it from its docstring, explain its code, or summarize its
  documentation. Correct by construction and plentiful, they cover coding and extraction.
* **the target's own self-instruct** (`self_instruct`; Wang et al., "Self-Instruct", 2023): the target is
  shown three seed tasks from one category (the hand-written `SEED_TASKS`, in MT-Bench's eight
  categories but none of its questions) and samples a new task at T = 0.8. These cover what code cannot:
  writing, roleplay, reasoning, math, STEM and the humanities, in the target's own words.

Both are seeded and deterministic; `training_prompts` interleaves them half and half.
"""
from __future__ import annotations

import ast
import random

import torch

from minispec.speculative.autoregressive import autoregressive_generate
from minispec.targets import corpus
from minispec.targets.mtbench import chat_prompt

SEED_TASKS = {
    "writing": ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
                "Draft a friendly email inviting your neighbours to a garden party next Saturday.",
                "Write a product description for a reusable water bottle made of bamboo.",
                "Compose a poem about the first snow of winter."],
    "roleplay": ["Pretend you are a tour guide in ancient Rome and welcome a group of visitors.",
                 "You are a chef on a cooking show. Explain how to make a simple tomato soup.",
                 "Act as a librarian helping a student find books about volcanoes.",
                 "Imagine you are a pirate captain giving a speech to your crew before a storm."],
    "reasoning": ["If all cats are animals and some animals are black, must some cats be black? Explain.",
                  "A train leaves at 3 pm and travels for 2 hours and 45 minutes. When does it arrive?",
                  "Tom is older than Anna, and Anna is older than Ben. Who is the youngest?",
                  "Why might a plant grow towards a window?"],
    "math": ["What is the sum of the first ten positive integers?",
             "Solve for x: 3x + 7 = 22.",
             "A rectangle is 8 cm long and 5 cm wide. What are its area and perimeter?",
             "What is 15 percent of 240?"],
    "coding": ["Write a Python function that checks whether a string is a palindrome.",
               "Explain the difference between a list and a tuple in Python.",
               "Write a SQL query that counts the orders of each customer.",
               "How do I read a CSV file in Python and print its first five rows?"],
    "extraction": ["List the names of the people mentioned in this sentence: Maria met John and Wei at the park.",
                   "Extract the date and the place from: The conference takes place on 12 May in Lisbon.",
                   "Give the main idea of this text in one sentence: Bees pollinate crops and make honey.",
                   "Turn this into a bullet list: apples, bread, milk and eggs are needed for the recipe."],
    "stem": ["Explain how photosynthesis works in simple terms.",
             "What is the difference between speed and velocity?",
             "Why is the sky blue?",
             "Describe what a black hole is."],
    "humanities": ["What were the main causes of the French Revolution?",
                   "Explain the idea of supply and demand.",
                   "Who was Confucius and what did he teach?",
                   "Why do people celebrate the new year in different ways around the world?"],
}

STDLIB_TEMPLATES = (
    "Write a Python function `{name}` that does the following: {summary}",
    "Explain what this Python code does:\n```python\n{code}\n```",
    "Summarize this documentation in two sentences:\n{doc}",
)
MAX_CODE_LINES = 24


def documented_definitions(files: list[corpus.SourceFile]) -> list[tuple[str, str, str]]:
    """(name, docstring, source) of every documented top-level or nested function and class."""
    found = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 5 and not node.name.startswith("_"):
                    source = "\n".join(lines[node.lineno - 1: min(node.end_lineno, node.lineno - 1 + MAX_CODE_LINES)])
                    found.append((node.name, doc.strip(), source))
    return found


def stdlib_requests(num: int, seed: int = 0, split: str = "train", offset: int = 0) -> list[str]:
    """`num` requests about documented definitions of the stdlib `split`, templates in turn: items
    `offset .. offset + num` of the definitions shuffled by `seed`, so consecutive offsets never repeat one."""
    definitions = documented_definitions(corpus.iter_files(split))
    if offset < 0 or len(definitions) < offset + num:
        raise ValueError(f"asked for stdlib requests {offset}..{offset + num} but the {split} split has "
                         f"{len(definitions)} documented definitions")
    random.Random(seed).shuffle(definitions)
    picked = definitions[offset: offset + num]
    requests = []
    for i, (name, doc, code) in enumerate(picked):
        summary = doc.split("\n\n")[0].replace("\n", " ")
        requests.append(STDLIB_TEMPLATES[i % len(STDLIB_TEMPLATES)].format(name=name, summary=summary, code=code,
                                                                          doc=doc[:600]))
    return requests


def self_instruct(model, tokenizer, num: int, seed: int = 0, batch_size: int = 32, max_len: int = 48,
                  temperature: float = 0.8) -> list[str]:
    """`num` new tasks sampled from the target, each shown three seed tasks of one category.

    T = 0.8 rather than 1: a 135 M model at T = 1 mostly wanders off the request. A task longer than
    `max_len` tokens is kept cut there; an empty one is dropped and drawn again with the next seeds.
    """
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    categories = sorted(SEED_TASKS)
    tasks: list[str] = []
    while len(tasks) < num:
        prompts = []
        for _ in range(min(batch_size, num - len(tasks))):
            shown = rng.sample(SEED_TASKS[categories[rng.randrange(len(categories))]], 3)
            listing = "\n".join(f"{i + 1}. {t}" for i, t in enumerate(shown))
            prompts.append(chat_prompt(tokenizer, f"Here are three example tasks:\n{listing}\nWrite one new task of "
                                                  "the same kind. Reply with the task only."))
        out = autoregressive_generate(model, prompts, max_len, temperature=temperature, generator=generator)
        for row, n in zip(out.tokens, out.lengths.tolist()):
            text = tokenizer.decode(row[:n], skip_special_tokens=True).strip()
            if text:
                tasks.append(text)
    return tasks


def training_prompts(model, tokenizer, num: int, seed: int = 0, split: str = "train",
                     part: int = 0) -> list[torch.Tensor]:
    """`num` chat prompts (token ids, chat template applied): requests about the stdlib `split` and
    self-instruct tasks in turn, half each. Parts 0, 1, 2, ... of one `seed` (each `num` prompts) never share
    a stdlib request and draw their self-instruct tasks from different seeds."""
    made = self_instruct(model, tokenizer, num // 2, seed * 1_000_003 + part)
    code = stdlib_requests(num - num // 2, seed, split, offset=part * (num - num // 2))
    texts = [t for pair in zip(code, made) for t in pair] + code[len(made):]
    return [chat_prompt(tokenizer, t) for t in texts]
