"""Langfuse traces, observations and scores -> rows.

A file holds, one per line, traces as the public API returns one with its details
(``TraceWithFullDetails``: ``observations`` and ``scores`` inside; SDK 3.x, Fern models) and/or
observations (``ObservationsView``; ``ObservationV2`` of SDK 5.x) and scores (``ScoreV1``
flat, or ``ScoreV3`` with a ``subject``) on lines of their own, joined by ``traceId``.
``GENERATION`` observations are the conversations (``input``: the messages, or ``{messages,
tools}`` when the OpenAI integration saw tools; ``output``: the answer message or its text);
``TOOL`` observations answer tool calls; ``SPAN``/``AGENT``/``CHAIN`` are structure; other
types are counted. Scores: NUMERIC and CATEGORICAL give ``score`` (the category's text in
``value``), BOOLEAN ``score`` 1/0 and ``value`` "True"/"False", CORRECTION a ``correction``,
TEXT a ``value``; a score on a session or a dataset run alone judges no trace (counted).
"""

from __future__ import annotations

import json
from collections import Counter

from rlcli.data.trace_imports.assemble import Call, Collected, ToolRun, Verdict
from rlcli.data.trace_imports.shaping import (
    FormatError,
    feedback,
    message,
    messages_list,
    openai_message,
    tool_definitions,
)

STRUCTURE = ("SPAN", "AGENT", "CHAIN")
SCORE_TYPES = ("NUMERIC", "BOOLEAN", "CATEGORICAL", "CORRECTION", "TEXT")


class Reader:
    def __init__(self) -> None:
        self.found = Collected()
        self.traces: set[str] = set()

    def add(self, row: dict, line: int) -> None:
        """Read one line; nothing of it is kept unless all of it is good."""
        whole, self.found = self.found, Collected()
        try:
            self._add(row, line)
            whole.merge(self.found)
        finally:
            self.found = whole

    def _add(self, row: dict, line: int) -> None:
        if isinstance(row.get("observations"), list):  # a trace with its details
            trace = _text(row, "id", "")
            for i, item in enumerate(row["observations"]):
                if isinstance(item, dict):  # TraceWithDetails lists ids only
                    self._observation(item, f"observations[{i}].", line, trace)
            for i, item in enumerate(row.get("scores") or ()):
                if isinstance(item, dict):
                    self._score(item, f"scores[{i}].", trace)
            self.traces.add(trace)
        elif "type" in row and ("traceId" in row or "startTime" in row):
            self._observation(row, "", line, None)
        elif "dataType" in row or ({"name", "source"} <= row.keys() and "value" in row):
            self._score(row, "", None)
        elif "id" in row and "timestamp" in row:  # a trace without its observations
            self.traces.add(_text(row, "id", ""))
        else:
            raise FormatError(
                "neither a trace (id, observations), an observation (type, traceId) "
                "nor a score (name, dataType, value)"
            )

    def collected(self) -> Collected:
        empty = self.traces - {c.trace for c in self.found.calls}
        if empty:
            self.found.unmapped["trace with no GENERATION observation"] += len(empty)
        return self.found

    def _observation(self, row: dict, where: str, line: int, trace: str | None) -> None:
        obs_id = _text(row, "id", where)
        trace = row.get("traceId") or trace
        if not isinstance(trace, str) or not trace:
            raise FormatError(f"{where}traceId: missing")
        kind = str(row.get("type", "")).upper()
        order = (str(row.get("startTime") or ""), line)
        self.found.owners[obs_id] = trace
        unmapped = self.found.unmapped
        if kind == "GENERATION":
            messages, tools = _request(row.get("input"), f"{where}input", unmapped)
            output = _answer(row.get("output"), f"{where}output", unmapped)
            self.found.calls.append(Call(trace, obs_id, order, messages, output, tools))
        elif kind == "TOOL":
            out = row.get("output")
            text = (
                out if isinstance(out, str) or out is None else json.dumps(out, ensure_ascii=False)
            )
            text = text or ""
            metadata = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
            call_id = metadata.get("tool_call_id")
            name = row.get("name") if isinstance(row.get("name"), str) else None
            self.found.tool_runs.append(ToolRun(trace, obs_id, order, name, call_id, text))
        elif kind not in STRUCTURE:
            unmapped[f"{kind or 'untyped'} observation"] += 1

    def _score(self, row: dict, where: str, trace: str | None) -> None:
        name = _text(row, "name", where)
        kind = str(row.get("dataType") or "NUMERIC").upper()
        if kind not in SCORE_TYPES:
            raise FormatError(f"{where}dataType: {kind!r} is none of {', '.join(SCORE_TYPES)}")
        value, text = row.get("value"), row.get("stringValue")
        if kind in ("NUMERIC", "CATEGORICAL", "BOOLEAN") and not isinstance(value, int | float):
            raise FormatError(f"{where}value: {value!r} is not a number ({kind} score)")
        source = str(row["source"]).lower() if row.get("source") else None
        comment = row.get("comment")
        if kind == "BOOLEAN":
            entry = feedback(name, float(value), text or str(bool(value)), comment, None, source)
        elif kind in ("NUMERIC", "CATEGORICAL"):
            entry = feedback(name, value, text, comment, None, source)
        elif kind == "CORRECTION":
            entry = feedback(name, None, None, comment, text, source)
        else:
            entry = feedback(name, None, text, comment, None, source)
        subject = row.get("subject") if isinstance(row.get("subject"), dict) else {}
        target = row.get("observationId") or (
            subject.get("id") if subject.get("kind") == "observation" else None
        )
        trace = (
            row.get("traceId")
            or subject.get("traceId")
            or (subject.get("id") if subject.get("kind") == "trace" else None)
            or trace
        )
        if not trace and not target:
            what = subject.get("kind") or ("session" if row.get("sessionId") else "dataset run")
            self.found.unmapped[f"score on a {what}, not a trace"] += 1
            return
        self.found.verdicts.append(Verdict(trace, target, entry))


def _text(row: dict, name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value:
        raise FormatError(f"{where}{name}: missing")
    return value


def _request(raw, where: str, unmapped: Counter) -> tuple[list[dict], list[dict]]:
    if isinstance(raw, str):  # a completion prompt
        return [message("user", raw)], []
    if isinstance(raw, list):
        return messages_list(raw, where, unmapped), []
    if isinstance(raw, dict) and isinstance(raw.get("messages"), list):
        tools = raw.get("tools") or raw.get("functions")
        return (
            messages_list(raw["messages"], f"{where}.messages", unmapped),
            tool_definitions(tools, f"{where}.tools"),
        )
    raise FormatError(f"{where}: a GENERATION needs messages, {{messages, tools}} or a prompt")


def _answer(raw, where: str, unmapped: Counter) -> dict | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return message("assistant", raw)
    if isinstance(raw, list):  # n > 1: every choice
        if not raw:
            return None
        unmapped["choice beyond the first"] += len(raw) - 1
        raw, where = raw[0], f"{where}[0]"
    if isinstance(raw, dict) and ({"role", "content", "tool_calls", "function_call"} & raw.keys()):
        # streamed answers and LangChain's tool-call outputs carry no role
        return openai_message({**raw, "role": raw.get("role") or "assistant"}, where, unmapped)
    raise FormatError(f"{where}: neither an answer message nor its text")
