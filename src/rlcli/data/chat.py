"""Chat JSONL for supervised fine-tuning: ``{"messages": [{"role", "content"}, ...]}`` per line.

Validation reads everything first and reports every bad line (up to a limit) with its line
number, so nothing is sent to a server for a file that would fail halfway through training.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rlcli.errors import RlcliError

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED = 20


@dataclass
class LineError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class DataError(RlcliError):
    """A dataset with bad lines; ``errors`` holds each one."""

    def __init__(
        self, source: str, errors: list[LineError], total: int, what: str = "chat data"
    ) -> None:
        self.source, self.errors, self.total = source, errors, total
        shown = "\n  ".join(str(e) for e in errors[:MAX_REPORTED])
        more = len(errors) - MAX_REPORTED
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(
            f"{source}: {len(errors)} of {total} lines are not usable {what}; "
            f"nothing was sent:\n  {shown}{tail}"
        )


def content_text(content) -> str | None:
    """Plain text of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", None) and "text" in part:
                parts.append(str(part["text"]))
            else:
                return None
        return "".join(parts)
    return None


def check_conversation(row) -> str | None:
    """Why this parsed line cannot be trained on, or None if it can."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    messages = row.get("messages")
    if messages is None:
        keys = ", ".join(sorted(row)) or "none"
        return f'no "messages" field (keys: {keys}); convert it with `rlcli import`'
    if not isinstance(messages, list):
        return '"messages" is not a list'
    if not messages:
        return "empty conversation"
    has_assistant = False
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is not an object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})"
        if content_text(message.get("content")) is None:
            return f"messages[{i}]: content is not text"
        if role == "assistant" and content_text(message["content"]).strip():
            has_assistant = True
    if not has_assistant:
        return "no assistant turn to learn from"
    return None


def read_jsonl(
    lines: Iterable[str], source: str, parse: Callable[[Any], tuple[Any, str | None]], what: str
) -> list:
    """Every line through ``parse`` (row -> (value, None) or (None, why not)); raise
    ``DataError`` listing every bad line, or saying there is nothing, before returning any."""
    values, errors, total = [], [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        total += 1
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(LineError(number, f"not JSON ({e.msg} at column {e.colno})"))
            continue
        value, problem = parse(row)
        if problem:
            errors.append(LineError(number, problem))
        else:
            values.append(value)
    if errors:
        raise DataError(source, errors, total, what)
    if not values:
        empty = "nothing came in on stdin" if source == "stdin" else "the file is empty"
        raise RlcliError(f"{source}: {empty} (no {what} to read)")
    return values


def stdin_text(stdin, flag: str) -> str:
    """What was piped into ``flag -``; a terminal (nothing piped) is one line saying how."""
    if stdin is None or stdin.isatty():
        raise RlcliError(
            f"{flag} -: stdin is a terminal, nothing was piped in; pipe a file "
            f"in (`{flag} - < FILE.jsonl`, or `rlcli import FILE -f openai | ...`) or pass "
            f"{flag} FILE.jsonl"
        )
    return stdin.read()


def _conversation(row) -> tuple[dict | None, str | None]:
    problem = check_conversation(row)
    if problem:
        return None, problem
    messages = [{"role": m["role"], "content": content_text(m["content"])} for m in row["messages"]]
    return {"messages": messages}, None


def read_conversations(lines: Iterable[str], source: str) -> list[dict]:
    """Parse and validate chat JSONL; raise ``DataError`` listing every bad line."""
    return read_jsonl(lines, source, _conversation, "chat data")
