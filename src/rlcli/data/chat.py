"""Chat JSONL for supervised fine-tuning: ``{"messages": [{"role", "content"}, ...]}`` per line.

Agents' conversations keep what makes them agents' (OpenAI's format, as ``rlcli traces export
--as sft`` writes it): an assistant message's ``tool_calls`` (``{"id"?, "type": "function",
"function": {"name", "arguments"}}``, its content then may be empty), a tool message's
``tool_call_id``, and the row's ``tools`` (the function specs the model was offered).
``compat/chat_messages.py`` turns them into what the cookbook's renderers take.

Validation reads everything first and reports every bad line (up to a limit) with its line
number, so nothing is sent to a server for a file that would fail halfway through training.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rlcli.data.trace_imports import shaping
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
    if row.get("tools") is not None and _tool_specs(row["tools"]) is None:
        return '"tools" is not a list of function specs ({"type": "function", "function": ...})'
    has_assistant = False
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is not an object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})"
        calls = message.get("tool_calls")
        if calls is not None and (role != "assistant" or _calls(calls) is None):
            return f"messages[{i}]: tool_calls must be an assistant's list of function calls"
        content = message.get("content")
        if content_text(content) is None and not (calls and content is None):
            return f"messages[{i}]: content is not text"
        if role == "assistant" and ((content_text(content) or "").strip() or calls):
            has_assistant = True
    if not has_assistant:
        return "no assistant turn to learn from"
    return None


def _calls(calls) -> list[dict] | None:
    """OpenAI tool calls as every importer writes them (``shaping.tool_calls``: arguments as a
    JSON string); None if they are not calls."""
    try:
        return shaping.tool_calls(calls, "tool_calls") if isinstance(calls, list) else None
    except shaping.FormatError:
        return None


def _tool_specs(tools) -> list[dict] | None:
    """The row's tools as function specs (``{"name", "description", "parameters"}``, what the
    cookbook's ``ToolSpec`` is), read as ``shaping.tool_definitions`` reads them; None if they
    are not."""
    try:
        functions = [t["function"] for t in shaping.tool_definitions(tools, "tools")]
    except shaping.FormatError:
        return None
    if not all(isinstance(f.get("name"), str) for f in functions):
        return None
    empty = {"type": "object", "properties": {}}
    return [{"name": f["name"], "description": f.get("description", ""),
             "parameters": f.get("parameters", empty)} for f in functions]  # fmt: skip


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
    messages = []
    for m in row["messages"]:
        message = {"role": m["role"], "content": content_text(m.get("content")) or ""}
        if m.get("tool_calls"):
            message["tool_calls"] = _calls(m["tool_calls"])
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        messages.append(message)
    out = {"messages": messages}
    if row.get("tools"):
        out["tools"] = _tool_specs(row["tools"])
    return out, None


def read_conversations(lines: Iterable[str], source: str) -> list[dict]:
    """Parse and validate chat JSONL; raise ``DataError`` listing every bad line."""
    return read_jsonl(lines, source, _conversation, "chat data")
