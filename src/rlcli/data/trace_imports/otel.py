"""OpenTelemetry GenAI traces (OTLP JSON, one export request per line) -> rows.

A line is an ``ExportTraceServiceRequest`` (``resourceSpans``) and/or an
``ExportLogsServiceRequest`` (``resourceLogs``) in OTLP's JSON mapping, as the collector's file
exporter writes them. A span is an LLM call when it carries its conversation in one of:

- GenAI semantic conventions (semconv 1.37+, ``opentelemetry-util-genai``):
  ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (``{role, parts: [{type: text,
  content} | {type: tool_call, id, name, arguments} | {type: tool_call_response, id,
  response}]}``), ``gen_ai.system_instructions``, ``gen_ai.tool.definitions``; as span
  attributes (JSON strings or structured) or on a ``gen_ai.client.inference.operation.details``
  event;
- the older event form (semconv 1.28-1.36, ``opentelemetry-instrumentation-openai-v2``):
  ``gen_ai.{system,user,assistant,tool}.message`` and ``gen_ai.choice`` log records (or span
  events) tied to the span, and the oldest ``gen_ai.content.prompt`` / ``.completion`` span
  events (``gen_ai.prompt`` / ``gen_ai.completion`` JSON);
- OpenInference's flattened attributes: ``llm.input_messages.N.message.role|content|contents|
  tool_calls.M.tool_call.*|tool_call_id``, ``llm.output_messages.N...``,
  ``llm.tools.N.tool.json_schema``.

``execute_tool`` spans (``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
``gen_ai.tool.call.result``) and OpenInference ``TOOL`` spans (``tool.name``,
``output.value``) answer tool calls. A ``gen_ai.evaluation.result`` event (``name``,
``score.value`` -> ``score``, ``score.label`` -> ``value``, ``explanation`` -> ``comment``)
judges the span it is tied to, or the span whose ``gen_ai.response.id`` it names.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from rlcli.data.trace_imports.assemble import Call, Collected, ToolRun, Verdict
from rlcli.data.trace_imports.shaping import (
    FormatError,
    as_json,
    feedback,
    message,
    openai_message,
    role,
    text_of,
    tool_call,
    tool_definitions,
)

CALL_OPS = ("chat", "text_completion", "generate_content")
STRUCTURE_OPS = ("invoke_agent", "create_agent", "invoke_workflow")
STRUCTURE_KINDS = ("CHAIN", "AGENT")
MESSAGE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
EVALUATION_EVENT = "gen_ai.evaluation.result"


@dataclass
class _Event:
    """A span event or log record, its meaning read when its line was: an input ``message``,
    the ``output``, a ``verdict`` entry, or conversation ``parts`` (the details event)."""

    time: int
    trace: str | None
    span: str | None
    message: dict | None = None
    output: dict | None = None
    prompt: list[dict] | None = None
    verdict: dict | None = None
    response_id: str | None = None
    parts: dict | None = None


@dataclass
class _Span:
    trace: str
    id: str
    start: tuple
    name: str
    attrs: dict
    parts: dict | None  # messages/output/tools read from its attributes
    events: list[_Event] = field(default_factory=list)


class Reader:
    def __init__(self) -> None:
        self.found = Collected()
        self.spans: list[_Span] = []
        self.logs: list[_Event] = []

    def add(self, row: dict, line: int) -> None:
        """Read one line; nothing of it is kept unless all of it is good."""
        spans, logs, unmapped = len(self.spans), len(self.logs), Counter()
        try:
            self._add(row, line, unmapped)
        except FormatError:
            del self.spans[spans:], self.logs[logs:]
            raise
        self.found.unmapped.update(unmapped)

    def _add(self, row: dict, line: int, unmapped: Counter) -> None:
        if "resourceSpans" not in row and "resourceLogs" not in row:
            raise FormatError("neither resourceSpans nor resourceLogs (an OTLP JSON request)")
        for where, item in _walk(row, "resourceSpans", "scopeSpans", "spans"):
            trace, span_id = _hex(item, "traceId", where), _hex(item, "spanId", where)
            attrs = attributes(item.get("attributes"), f"{where}.attributes")
            start = (int(item.get("startTimeUnixNano") or 0), line)
            span = _Span(trace, span_id, start, str(item.get("name", "")), attrs,
                         _parts(attrs, f"{where}.attributes", unmapped))  # fmt: skip
            for i, raw in enumerate(item.get("events") or ()):
                at = f"{where}.events[{i}]"
                if not isinstance(raw, dict):
                    raise FormatError(f"{at}: not an object")
                event_attrs = attributes(raw.get("attributes"), f"{at}.attributes")
                event = _event(raw.get("name"), event_attrs, event_attrs, raw, at, unmapped)
                if event is not None:
                    span.events.append(event)
            self.spans.append(span)
        for where, item in _walk(row, "resourceLogs", "scopeLogs", "logRecords"):
            attrs = attributes(item.get("attributes"), f"{where}.attributes")
            name = item.get("eventName") or attrs.get("event.name")
            body = value(item["body"], f"{where}.body") if "body" in item else None
            event = _event(name, attrs, body, item, where, unmapped)
            if event is not None:
                event.trace = item.get("traceId") or None
                event.span = item.get("spanId") or None
                self.logs.append(event)

    def collected(self) -> Collected:
        by_id = {(s.trace, s.id): s for s in self.spans}
        by_response = {s.attrs["gen_ai.response.id"]: s for s in self.spans
                       if isinstance(s.attrs.get("gen_ai.response.id"), str)}  # fmt: skip
        for event in self.logs:
            span = by_id.get((event.trace, event.span)) or by_response.get(event.response_id)
            if span is not None:
                span.events.append(event)
            elif event.verdict is not None and event.trace:
                self.found.verdicts.append(Verdict(event.trace, None, event.verdict))
            else:
                self.found.unmapped["event tied to no span in the input"] += 1
        for span in self.spans:
            self.found.owners[span.id] = span.trace
            self._span(span)
        return self.found

    def _span(self, span: _Span) -> None:
        attrs, unmapped = span.attrs, self.found.unmapped
        events = sorted(span.events, key=lambda e: e.time)
        for event in events:
            if event.verdict is not None:
                self.found.verdicts.append(Verdict(span.trace, span.id, event.verdict))
        op = attrs.get("gen_ai.operation.name")
        kind = str(attrs.get("openinference.span.kind", "")).upper()
        parts = span.parts or next((e.parts for e in events if e.parts), None)
        said = [e for e in events if e.message or e.output or e.prompt]
        if op == "execute_tool" or kind == "TOOL":
            self.found.tool_runs.append(_tool_run(span))
        elif parts or said or op in CALL_OPS or kind == "LLM":
            call = _call(span, parts, said)
            if call is None:
                unmapped["LLM span with no recorded content (content capture off?)"] += 1
            else:
                self.found.calls.append(call)
        elif op and op not in STRUCTURE_OPS:
            unmapped[f"{op} span"] += 1
        elif kind and kind not in STRUCTURE_KINDS:
            unmapped[f"{kind} span"] += 1


def _call(span: _Span, parts: dict | None, said: list[_Event]) -> Call | None:
    if parts and (parts["messages"] or parts["output"]):
        messages, output, tools = parts["messages"], parts["output"], parts["tools"]
    else:
        messages, output = [], None
        for event in said:
            messages.extend(event.prompt or ([event.message] if event.message else []))
            output = output or event.output
        tools = parts["tools"] if parts else []
        if not messages and output is None:
            return None
    return Call(span.trace, span.id, span.start, messages, output, tools)


def _tool_run(span: _Span) -> ToolRun:
    attrs = span.attrs
    name = attrs.get("gen_ai.tool.name") or attrs.get("tool.name") or span.name
    result = attrs.get("gen_ai.tool.call.result", attrs.get("output.value"))
    if result is not None and not isinstance(result, str):
        result = json.dumps(result, ensure_ascii=False)
    call_id = attrs.get("gen_ai.tool.call.id")
    return ToolRun(span.trace, span.id, span.start, name, call_id, result or "")


def _walk(row: dict, top: str, scope: str, items: str):
    """``(where, item)`` for every span or log record of an OTLP request."""
    for i, resource in enumerate(_list(row, top, "")):
        for j, scoped in enumerate(_list(resource, scope, f"{top}[{i}].")):
            where = f"{top}[{i}].{scope}[{j}].{items}"
            for k, item in enumerate(_list(scoped, items, "")):
                if not isinstance(item, dict):
                    raise FormatError(f"{where}[{k}]: not an object")
                yield f"{where}[{k}]", item


def _list(node, name: str, where: str) -> list:
    if not isinstance(node, dict):
        raise FormatError(f"{where.rstrip('.')}: not an object")
    found = node.get(name, [])
    if not isinstance(found, list):
        raise FormatError(f"{where}{name}: not a list")
    return found


def _hex(item: dict, name: str, where: str) -> str:
    found = item.get(name)
    if not isinstance(found, str) or not found:
        raise FormatError(f"{where}.{name}: missing")
    return found


def value(any_value, where: str):
    """An OTLP ``AnyValue`` in its JSON mapping as a Python value."""
    if not isinstance(any_value, dict):
        raise FormatError(f"{where}: not an AnyValue object")
    if "stringValue" in any_value:
        return any_value["stringValue"]
    if "boolValue" in any_value:
        return bool(any_value["boolValue"])
    if "intValue" in any_value:  # int64 is a JSON string in OTLP
        try:
            return int(any_value["intValue"])
        except (TypeError, ValueError):
            raise FormatError(
                f"{where}.intValue: {any_value['intValue']!r} is not an integer"
            ) from None
    if "doubleValue" in any_value:
        return float(any_value["doubleValue"])
    if "arrayValue" in any_value:
        values = (any_value["arrayValue"] or {}).get("values", [])
        return [value(v, f"{where}.arrayValue.values[{i}]") for i, v in enumerate(values)]
    if "kvlistValue" in any_value:
        return attributes(
            (any_value["kvlistValue"] or {}).get("values", []), f"{where}.kvlistValue"
        )
    if "bytesValue" in any_value:
        return any_value["bytesValue"]
    return None


def attributes(raw, where: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise FormatError(f"{where}: not a list")
    out = {}
    for i, kv in enumerate(raw):
        if not isinstance(kv, dict) or not isinstance(kv.get("key"), str):
            raise FormatError(f"{where}[{i}]: not a {{key, value}} object")
        out[kv["key"]] = value(kv.get("value", {}), f"{where}[{i}].value")
    return out


def _parts(attrs: dict, where: str, unmapped: Counter) -> dict | None:
    """The conversation a span's attributes (or a details event's) carry, in semconv or
    OpenInference form; None when they carry none."""
    if "gen_ai.input.messages" in attrs or "gen_ai.output.messages" in attrs:
        messages = []
        system = as_json(
            attrs.get("gen_ai.system_instructions"), f"{where}[gen_ai.system_instructions]"
        )
        if system:
            messages.append(
                message("system", text_of(system, f"{where}[gen_ai.system_instructions]", unmapped))
            )
        at = f"{where}[gen_ai.input.messages]"
        messages += semconv_messages(
            as_json(attrs.get("gen_ai.input.messages"), at) or [], at, unmapped
        )
        at = f"{where}[gen_ai.output.messages]"
        outputs = semconv_messages(
            as_json(attrs.get("gen_ai.output.messages"), at) or [], at, unmapped
        )
        at = f"{where}[gen_ai.tool.definitions]"
        tools = tool_definitions(as_json(attrs.get("gen_ai.tool.definitions"), at), at)
        return {"messages": messages, "output": _first(outputs, unmapped), "tools": tools}
    tree = unflatten(attrs, "llm.")
    if "input_messages" in tree or "output_messages" in tree:
        inputs = [openinference_message(m, f"{where}[llm.input_messages.{i}]", unmapped)
                  for i, m in enumerate(_items(tree.get("input_messages")))]  # fmt: skip
        outputs = [openinference_message(m, f"{where}[llm.output_messages.{i}]", unmapped)
                   for i, m in enumerate(_items(tree.get("output_messages")))]  # fmt: skip
        tools = []
        for i, tool in enumerate(_items(tree.get("tools"))):
            at = f"{where}[llm.tools.{i}.tool.json_schema]"
            schema = as_json((tool.get("tool") or {}).get("json_schema"), at)
            tools += tool_definitions([schema], at)
        return {"messages": inputs, "output": _first(outputs, unmapped), "tools": tools}
    return None


def _first(outputs: list[dict], unmapped: Counter) -> dict | None:
    unmapped["choice beyond the first"] += max(len(outputs) - 1, 0)
    return outputs[0] if outputs else None


def semconv_messages(raw, where: str, unmapped: Counter) -> list[dict]:
    """GenAI ``{role, parts, name?}`` messages; a ``tool_call_response`` part becomes a tool
    message of its own (one message may answer several calls)."""
    if not isinstance(raw, list):
        raise FormatError(f"{where}: not a list of messages")
    out = []
    for i, m in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("parts"), list):
            raise FormatError(f"{at}.parts: missing (a GenAI message is {{role, parts}})")
        who = role(m.get("role"), at)
        texts, calls, replies = [], [], []
        for j, part in enumerate(m["parts"]):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("content", "")))
            elif kind == "tool_call":
                calls.append(tool_call(part, f"{at}.parts[{j}]"))
            elif kind == "tool_call_response":
                reply = part.get("response")
                if not isinstance(reply, str):
                    reply = json.dumps(reply, ensure_ascii=False)
                replies.append(message("tool", reply, call_id=part.get("id")))
            else:
                unmapped[f"{kind or 'untyped'} message part"] += 1
        if replies:
            out += replies
            if texts and who != "tool":
                out.append(message(who, "".join(texts)))
        else:
            out.append(message(who, "".join(texts), calls, name=m.get("name")))
    return out


def unflatten(attrs: dict, prefix: str) -> dict:
    """``{"llm.input_messages.0.message.role": "user"}`` -> ``{"input_messages": {0:
    {"message": {"role": "user"}}}}`` (numeric parts become int keys)."""
    tree: dict = {}
    for key, val in attrs.items():
        if not key.startswith(prefix):
            continue
        node = tree
        *path, last = (int(p) if p.isdigit() else p for p in key[len(prefix) :].split("."))
        for p in path:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                break
        else:
            node[last] = val
    return tree


def _items(node) -> list:
    if not isinstance(node, dict):
        return []
    return [node[k] for k in sorted(k for k in node if isinstance(k, int))]


def openinference_message(node, where: str, unmapped: Counter) -> dict:
    m = node.get("message") if isinstance(node, dict) else None
    if not isinstance(m, dict):
        raise FormatError(f"{where}.message: missing")
    content = m.get("content")
    if content is None and "contents" in m:
        content = []
        for part in _items(m["contents"]):
            piece = part.get("message_content", {}) if isinstance(part, dict) else {}
            content.append({"type": piece.get("type", "text"), "text": piece.get("text")})
    calls = []
    for i, tc in enumerate(_items(m.get("tool_calls"))):
        call = tc.get("tool_call", {}) if isinstance(tc, dict) else {}
        calls.append(tool_call(call, f"{where}.message.tool_calls.{i}.tool_call"))
    who = role(m.get("role"), f"{where}.message")
    text = text_of(content, f"{where}.message.content", unmapped)
    return message(who, text, calls, m.get("tool_call_id"), m.get("name"))


def _event(name, attrs: dict, body, raw: dict, where: str, unmapped: Counter) -> _Event | None:
    """Read one span event or log record now, so a bad one is reported with its line."""
    time = int(raw.get("timeUnixNano") or raw.get("observedTimeUnixNano") or 0)
    event = _Event(time, None, None)
    if name in MESSAGE_EVENTS:
        body = body if isinstance(body, dict) else {}
        if "content" not in body and not body.get("tool_calls"):
            unmapped["message event with no content (content capture off?)"] += 1
            return None
        who = MESSAGE_EVENTS[name]
        raw_message = {
            **body,
            "role": who,
            "tool_call_id": body.get("id") if who == "tool" else None,
        }
        event.message = openai_message(raw_message, f"{where}.body", unmapped)
    elif name == "gen_ai.choice":
        body = body if isinstance(body, dict) else {}
        if int(body.get("index") or 0) > 0:
            unmapped["choice beyond the first"] += 1
            return None
        answer = body.get("message") if isinstance(body.get("message"), dict) else {}
        answer = {**answer, "role": answer.get("role") or "assistant"}
        event.output = openai_message(answer, f"{where}.body.message", unmapped)
    elif name == "gen_ai.content.prompt":
        at = f"{where}.attributes[gen_ai.prompt]"
        prompt = as_json(attrs.get("gen_ai.prompt"), at)
        if not isinstance(prompt, list):
            raise FormatError(f"{at}: not a list of messages")
        event.prompt = [openai_message(m, f"{at}[{i}]", unmapped) for i, m in enumerate(prompt)]
    elif name == "gen_ai.content.completion":
        at = f"{where}.attributes[gen_ai.completion]"
        answers = as_json(attrs.get("gen_ai.completion"), at)
        answers = answers if isinstance(answers, list) else [answers]
        if not answers or not isinstance(answers[0], dict):
            raise FormatError(f"{at}: not a list of messages")
        unmapped["choice beyond the first"] += len(answers) - 1
        first = answers[0].get("message", answers[0])
        event.output = openai_message(
            {**first, "role": first.get("role") or "assistant"}, at, unmapped
        )
    elif name == DETAILS_EVENT:
        event.parts = _parts(attrs, f"{where}.attributes", unmapped)
    elif name == EVALUATION_EVENT:
        return _evaluation(event, attrs, where, unmapped)
    else:
        return None
    return event


def _evaluation(event: _Event, attrs: dict, where: str, unmapped: Counter) -> _Event | None:
    key = attrs.get("gen_ai.evaluation.name")
    if not isinstance(key, str) or not key:
        raise FormatError(f"{where}.attributes[gen_ai.evaluation.name]: missing")
    if attrs.get("error.type"):
        unmapped["evaluation that failed (error.type)"] += 1
        return None
    score = attrs.get("gen_ai.evaluation.score.value")
    if score is not None and not isinstance(score, int | float):
        raise FormatError(f"{where}.attributes[gen_ai.evaluation.score.value]: not a number")
    event.verdict = feedback(
        key, score, attrs.get("gen_ai.evaluation.score.label"),
        attrs.get("gen_ai.evaluation.explanation"), None, "evaluation",
    )  # fmt: skip
    event.response_id = attrs.get("gen_ai.response.id")
    return event
