"""Prompts JSONL for on-policy distillation: ``{"prompt": "..."}`` or ``{"messages": [...]}``.

For ``messages`` the last user turn is the prompt and the text turns before it (system, user,
assistant) are its context; assistant turns after it (a logged answer) are dropped: the student
writes its own. As for chat data (``chat.py``), every bad line is reported by number before
anything is sent.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from rlcli.data.chat import content_text, read_jsonl

CONTEXT_ROLES = ("system", "user", "assistant")


def to_prompt(row) -> tuple[dict | None, str | None]:
    """(``{"prompt", "context"}``, None) for a usable parsed line, else (None, why not)."""
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            return None, '"prompt" is not a non-empty string'
        return {"prompt": prompt, "context": []}, None
    messages = row.get("messages")
    if messages is None:
        keys = ", ".join(sorted(row)) or "none"
        return None, f'no "prompt" or "messages" field (keys: {keys})'
    if not isinstance(messages, list) or not messages:
        return None, '"messages" is not a non-empty list'
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return None, f"messages[{i}] is not an object"
        role, text = message.get("role"), content_text(message.get("content"))
        if role not in CONTEXT_ROLES:
            return None, f"messages[{i}]: role {role!r} (expected one of system, user, assistant)"
        if text is None:
            return None, f"messages[{i}]: content is not text"
        turns.append({"role": role, "content": text})
    while turns and turns[-1]["role"] == "assistant":  # a logged answer: the student writes its own
        turns.pop()
    if not turns or turns[-1]["role"] != "user":
        return None, "no user turn to use as the prompt"
    if not turns[-1]["content"].strip():
        return None, "the last user turn is empty"
    return {"prompt": turns[-1]["content"], "context": turns[:-1]}, None


def read_prompts(lines: Iterable[str], source: str) -> list[dict]:
    """Parse and validate prompts JSONL; raise ``DataError`` listing every bad line."""
    return read_jsonl(lines, source, to_prompt, "prompts")


def shuffled_prompts(path: str, seed: int) -> list[dict]:
    """The prompts in the order the run sees them (shuffled by ``--seed``)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        prompts = read_prompts(f, path)
    random.Random(seed).shuffle(prompts)
    return prompts
