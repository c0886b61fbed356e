"""Turn chat logs (OpenAI, Anthropic, messages, ShareGPT dumps) and traces (LangSmith,
Langfuse, OpenTelemetry GenAI) into training JSONL.

Each chat-log format is one function from a parsed line to a list of ``{"role", "content"}``
messages; each trace format a reader that joins a file's lines into conversations
(``rlcli.data.trace_imports``), rows with ``tools`` and ``feedback`` beside the messages.
``import_lines`` runs either over a file, skips what cannot be trained on (and counts why),
counts what a trace held that no row can (``unmapped``), and reports bad lines by number.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from rlcli.data.chat import LineError
from rlcli.data.trace_imports import READERS, RECORDS
from rlcli.data.trace_imports.assemble import assemble
from rlcli.data.trace_imports.shaping import ROLE_ALIASES, FormatError

__all__ = ["FORMATS", "ROLE_ALIASES", "FormatError", "ImportReport", "import_lines"]


def _dig(row: dict, *paths: str):
    """The first present value among dotted paths (``request.messages``, ``messages``)."""
    for path in paths:
        node = row
        for key in path.split("."):
            if isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            elif isinstance(node, dict) and key in node:
                node = node[key]
            else:
                break
        else:
            return node
    return None


def _text(content, keep_tools: bool) -> str:
    """Flatten OpenAI content parts or Anthropic content blocks to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FormatError(f"content of type {type(content).__name__} is not text")
    pieces = []
    for block in content:
        if isinstance(block, str):
            pieces.append(block)
            continue
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("text", "input_text", "output_text"):
            pieces.append(str(block.get("text", "")))
        elif kind in ("tool_use", "tool_result") and keep_tools:
            body = block.get("input") if kind == "tool_use" else block.get("content")
            if kind == "tool_result" and isinstance(body, list):
                body = _text(body, keep_tools)
            label = block.get("name", block.get("tool_use_id"))
            pieces.append(json.dumps({kind: label, "data": body}))
        # images, thinking, tool blocks (when not kept): no text to learn from
    return "".join(pieces)


def _role(value, where: str) -> str:
    role = ROLE_ALIASES.get(str(value).lower()) if value is not None else None
    if role is None:
        raise FormatError(f"{where}: unknown role {value!r}")
    return role


def _openai_message(message: dict, keep_tools: bool, where: str) -> dict | None:
    if not isinstance(message, dict):
        raise FormatError(f"{where}: not an object")
    role = _role(message.get("role"), where)
    text = _text(message.get("content"), keep_tools)
    calls = message.get("tool_calls") or []
    if message.get("function_call"):  # the pre-tools API
        calls = [message["function_call"]]
    if role == "tool" and not keep_tools:
        return None
    if calls:
        if not keep_tools:
            return {"role": role, "content": text} if text.strip() else None
        text += "".join(json.dumps({"tool_call": c.get("function", c)}) for c in calls)
    return {"role": role, "content": text}


def _openai_messages(messages: list, keep_tools: bool) -> list[dict]:
    converted = (
        _openai_message(message, keep_tools, f"messages[{i}]") for i, message in enumerate(messages)
    )
    return [m for m in converted if m]


def from_openai(row: dict, keep_tools: bool) -> list[dict]:
    """Chat-completions logs: request messages plus the response's chosen message. Accepts
    ``{request, response}``, batch-API ``{body, response: {body}}`` and flat layouts."""
    messages = _dig(row, "request.messages", "body.messages", "messages", "input")
    if not isinstance(messages, list):
        raise FormatError('no request "messages" list (looked in request, body and top level)')
    out = _openai_messages(messages, keep_tools)
    chosen = _dig(
        row,
        "response.choices.0.message",
        "response.body.choices.0.message",
        "choices.0.message",
        "completion.choices.0.message",
    )
    if chosen is not None:
        converted = _openai_message(chosen, keep_tools, "response message")
        if converted:
            out.append(converted)
    return out


def from_anthropic(row: dict, keep_tools: bool) -> list[dict]:
    """Messages API logs: top-level ``system`` kept as a system message, content blocks
    flattened to text, the response's content appended as the assistant turn."""
    request = row.get("request") if isinstance(row.get("request"), dict) else row
    messages = _dig(request, "messages", "params.messages")
    if not isinstance(messages, list):
        raise FormatError('no "messages" list')
    out = []
    system = _dig(request, "system", "params.system")
    if system:
        out.append({"role": "system", "content": _text(system, keep_tools)})
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise FormatError(f"messages[{i}]: not an object")
        role = _role(message.get("role"), f"messages[{i}]")
        text = _text(message.get("content"), keep_tools)
        if text.strip() or role == "assistant":
            out.append({"role": role, "content": text})
    response = _dig(row, "response", "completion")
    if isinstance(response, dict) and "content" in response:
        out.append({"role": "assistant", "content": _text(response["content"], keep_tools)})
    return [m for m in out if m["content"].strip()]


def from_messages(row: dict, keep_tools: bool) -> list[dict]:
    """Already ``{"messages": [...]}``; roles normalized (human -> user, ai/model/bot ->
    assistant), content parts flattened."""
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise FormatError('no "messages" list')
    return _openai_messages(messages, keep_tools)


def from_sharegpt(row: dict, keep_tools: bool) -> list[dict]:
    turns = row.get("conversations", row.get("conversation"))
    if not isinstance(turns, list):
        raise FormatError('no "conversations" list')
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "value" not in turn:
            raise FormatError(f"conversations[{i}]: expected an object with from/value")
        role = _role(turn.get("from"), f"conversations[{i}]")
        if role == "tool" and not keep_tools:
            continue
        out.append({"role": role, "content": _text(turn["value"], keep_tools)})
    if isinstance(row.get("system"), str) and row["system"].strip():
        out.insert(0, {"role": "system", "content": row["system"]})
    return out


FORMATS: dict[str, Callable[[dict, bool], list[dict]]] = {
    "openai": from_openai,
    "anthropic": from_anthropic,
    "messages": from_messages,
    "sharegpt": from_sharegpt,
}


# Every format ``rlcli import -f`` takes: chat logs line by line, then traces.
ALL_FORMATS = (*FORMATS, *READERS)


@dataclass
class ImportReport:
    read: int = 0
    written: int = 0
    skipped: Counter = field(default_factory=Counter)
    errors: list[LineError] = field(default_factory=list)
    unmapped: Counter = field(default_factory=Counter)
    discarded: bool = False  # --strict refused the file: the rows read were not written

    def summary(self) -> str:
        written = f"wrote {self.written}"
        if self.discarded:
            written = f"{self.written} usable, none written"
        parts = [f"read {self.read}", written]
        parts += [f"skipped {n} ({why})" for why, n in sorted(self.skipped.items())]
        if self.errors:
            parts.append(f"{len(self.errors)} bad lines")
        unmapped = [f"{n} {what}" for what, n in sorted(self.unmapped.items()) if n]
        if unmapped:
            parts.append("not mapped: " + "; ".join(unmapped))
        return ", ".join(parts)


def import_lines(
    lines: Iterable[str],
    fmt: str,
    *,
    keep_tools: bool = False,
    min_messages: int = 2,
    limit: int | None = None,
    report: ImportReport,
) -> Iterator[dict]:
    """Yield ``{"messages": [...]}`` rows; bad lines and skips are recorded in ``report``."""
    if fmt in READERS:
        yield from _import_traces(lines, fmt, min_messages=min_messages, limit=limit, report=report)
        return
    convert = FORMATS[fmt]
    for number, line in enumerate(lines, start=1):
        if limit is not None and report.written >= limit:
            return
        if not line.strip():
            continue
        report.read += 1
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise FormatError(f"expected a JSON object, got {type(row).__name__}")
            messages = convert(row, keep_tools)
        except json.JSONDecodeError as e:
            report.errors.append(LineError(number, f"not JSON ({e.msg} at column {e.colno})"))
            continue
        except FormatError as e:
            report.errors.append(LineError(number, f"not a {fmt} record: {e}"))
            continue
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            report.skipped["no assistant turn"] += 1
            continue
        if len(messages) < min_messages:
            report.skipped[f"under {min_messages} messages"] += 1
            continue
        report.written += 1
        yield {"messages": messages}


def _import_traces(
    lines: Iterable[str], fmt: str, *, min_messages: int, limit: int | None, report: ImportReport
) -> Iterator[dict]:
    """A trace format: every line read first (a conversation's pieces may be on any line),
    then one row per conversation with ``origin`` naming the trace and call it came from."""
    reader = READERS[fmt]()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        report.read += 1
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise FormatError(f"expected a JSON object, got {type(row).__name__}")
            reader.add(row, number)
        except json.JSONDecodeError as e:
            report.errors.append(LineError(number, f"not JSON ({e.msg} at column {e.colno})"))
        except FormatError as e:
            report.errors.append(LineError(number, f"not {RECORDS[fmt]}: {e}"))
    found = reader.collected()
    for row, trace, call in assemble(found):
        if limit is not None and report.written >= limit:
            break
        messages = row["messages"]
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            report.skipped["no assistant turn"] += 1
            continue
        if len(messages) < min_messages:
            report.skipped[f"under {min_messages} messages"] += 1
            continue
        report.written += 1
        yield {**row, "origin": {"format": fmt, "trace_id": trace, "call_id": call}}
    report.unmapped.update(+found.unmapped)  # + drops the kinds counted zero times
