"""LangSmith runs and feedback (``langsmith.schemas.Run`` / ``Feedback``, SDK 0.15) -> rows.

A file holds runs as ``Client.list_runs`` yields them (``run.dict()`` or the REST JSON, one per
line, ``child_runs`` nested or not, ``inputs``/``outputs`` as objects or as the JSON strings
of the bulk export) and, on lines of their own, feedback as ``Client.list_feedback`` yields it
(or a ``feedback`` list on a run). ``llm`` runs are the conversations: OpenAI-shaped
(``wrap_openai``: ``inputs.messages``, ``inputs.tools``, ``outputs.choices``) or
LangChain-shaped (``inputs.messages`` as serialized messages, batched or not;
``outputs.generations``; tools in ``extra.invocation_params``); ``tool`` runs answer tool
calls; ``chain``/``prompt``/``parser`` runs are structure; other run types are counted.
"""

from __future__ import annotations

import json
from collections import Counter

from rlcli.data.trace_imports.assemble import Call, Collected, ToolRun, Verdict
from rlcli.data.trace_imports.shaping import (
    FormatError,
    any_message,
    as_json,
    feedback,
    message,
    messages_list,
    openai_message,
    text_of,
    tool_definitions,
)

STRUCTURE = ("chain", "prompt", "parser")


class Reader:
    def __init__(self) -> None:
        self.found = Collected()
        self.parent: dict[str, str | None] = {}
        self.trace: dict[str, str | None] = {}

    def add(self, row: dict, line: int) -> None:
        """Read one line; nothing of it is kept unless all of it is good."""
        staged = _Line()
        if "run_type" in row:
            staged.run(row, "", line, None, None)
        elif "key" in row and ("run_id" in row or "trace_id" in row):
            staged.found.verdicts.append(_verdict(row, "", None))
        else:
            raise FormatError("neither a run (run_type) nor feedback (key and run_id)")
        self.found.merge(staged.found)
        self.parent.update(staged.parent)
        self.trace.update(staged.trace)

    def collected(self) -> Collected:
        for item in (*self.found.calls, *self.found.tool_runs):
            item.trace = self._trace_of(item.id)
        self.found.owners.update({run: self._trace_of(run) for run in self.parent})
        return self.found

    def _trace_of(self, run: str) -> str:
        """A run's trace: its ``trace_id``, else its nearest ancestor's, else its root's id."""
        seen = set()
        while self.trace.get(run) is None and self.parent.get(run) and run not in seen:
            seen.add(run)
            run = self.parent[run]
        return self.trace.get(run) or run


class _Line:
    """What one line holds, runs nested in ``child_runs`` included."""

    def __init__(self) -> None:
        self.found = Collected()
        self.parent: dict[str, str | None] = {}
        self.trace: dict[str, str | None] = {}

    def run(self, row, where: str, line: int, parent, trace) -> None:
        if not isinstance(row, dict):
            raise FormatError(f"{where or 'run'}: not an object")
        run_id, kind = _text_field(row, "id", where), row.get("run_type")
        self.parent[run_id] = _optional_id(row, "parent_run_id") or parent
        self.trace[run_id] = _optional_id(row, "trace_id") or trace
        order = (str(row.get("start_time") or ""), str(row.get("dotted_order") or ""), line)
        unmapped = self.found.unmapped
        if kind == "llm":
            messages, tools = _request(row, where, unmapped)
            output = _answer(row.get("outputs"), f"{where}outputs", unmapped)
            self.found.calls.append(Call("", run_id, order, messages, output, tools))
        elif kind == "tool":
            name = row.get("name") if isinstance(row.get("name"), str) else None
            call_id, output = _tool_output(row.get("outputs"), f"{where}outputs", unmapped)
            self.found.tool_runs.append(ToolRun("", run_id, order, name, call_id, output))
        elif kind not in STRUCTURE:
            unmapped[f"{kind} run"] += 1
        entries = row.get("feedback") or []
        if not isinstance(entries, list):
            raise FormatError(f"{where}feedback: not a list")
        for i, entry in enumerate(entries):
            self.found.verdicts.append(_verdict(entry, f"{where}feedback[{i}].", run_id))
        children = row.get("child_runs") or []
        if not isinstance(children, list):
            raise FormatError(f"{where}child_runs: not a list")
        for i, child in enumerate(children):
            self.run(child, f"{where}child_runs[{i}].", line, run_id, self.trace[run_id])


def _text_field(row: dict, name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value:
        raise FormatError(f"{where}{name}: missing")
    return value


def _optional_id(row: dict, name: str) -> str | None:
    value = row.get(name)
    return str(value) if value else None


def _request(row: dict, where: str, unmapped: Counter) -> tuple[list[dict], list[dict]]:
    inputs = as_json(row.get("inputs"), f"{where}inputs")
    if not isinstance(inputs, dict):
        raise FormatError(f"{where}inputs: not an object")
    raw, at = inputs.get("messages"), f"{where}inputs.messages"
    if isinstance(raw, list) and raw and isinstance(raw[0], list):  # LangChain: a batch
        unmapped["batched prompt beyond the first"] += len(raw) - 1
        raw, at = raw[0], f"{at}[0]"
    if raw is not None:
        messages = messages_list(raw, at, unmapped)
    elif "prompts" in inputs or "prompt" in inputs:  # a completion model
        prompts = inputs.get("prompts", [inputs.get("prompt")])
        if not isinstance(prompts, list) or not prompts or not isinstance(prompts[0], str):
            raise FormatError(f"{where}inputs.prompts: not a list of strings")
        unmapped["batched prompt beyond the first"] += len(prompts) - 1
        messages = [message("user", prompts[0])]
    else:
        raise FormatError(f"{at}: an llm run needs messages (chat) or prompts (completion)")
    system = inputs.get("system")  # wrap_anthropic keeps the system prompt beside messages
    if system:
        messages.insert(0, message("system", text_of(system, f"{where}inputs.system", unmapped)))
    extra = row.get("extra") if isinstance(row.get("extra"), dict) else {}
    params = (
        extra.get("invocation_params") if isinstance(extra.get("invocation_params"), dict) else {}
    )
    for source, at in ((inputs, "inputs"), (params, "extra.invocation_params")):
        for name in ("tools", "functions"):
            if source.get(name):
                return messages, tool_definitions(source[name], f"{where}{at}.{name}")
    return messages, []


def _answer(outputs, where: str, unmapped: Counter) -> dict | None:
    """The answer: ``choices[0].message`` (OpenAI), ``generations[0][0].message`` (LangChain),
    a message itself, ``message`` or ``output``; None when the run recorded none (an error)."""
    outputs = as_json(outputs, where)
    if not outputs:
        return None
    if not isinstance(outputs, dict):
        raise FormatError(f"{where}: not an object")
    if "choices" in outputs:
        choices = outputs["choices"]
        if not isinstance(choices, list):
            raise FormatError(f"{where}.choices: not a list")
        if not choices:
            return None
        unmapped["choice beyond the first"] += len(choices) - 1
        first = choices[0]
        if isinstance(first, dict) and "message" in first:
            return openai_message(first["message"], f"{where}.choices[0].message", unmapped)
        if isinstance(first, dict) and isinstance(first.get("text"), str):
            return message("assistant", first["text"])
        raise FormatError(f"{where}.choices[0]: neither a message nor a text")
    if "generations" in outputs:
        generations, at = outputs["generations"], f"{where}.generations"
        if isinstance(generations, list) and generations and isinstance(generations[0], list):
            unmapped["batched prompt beyond the first"] += len(generations) - 1
            generations, at = generations[0], f"{at}[0]"
        if not isinstance(generations, list):
            raise FormatError(f"{at}: not a list")
        if not generations:
            return None
        unmapped["choice beyond the first"] += len(generations) - 1
        first = generations[0]
        if isinstance(first, dict) and isinstance(first.get("message"), dict):
            return any_message(first["message"], f"{at}[0].message", unmapped)
        if isinstance(first, dict) and isinstance(first.get("text"), str):
            return message("assistant", first["text"])
        raise FormatError(f"{at}[0]: neither a message nor a text")
    if "role" in outputs or "lc" in outputs:
        return any_message(outputs, where, unmapped)
    if isinstance(outputs.get("message"), dict):
        return any_message(outputs["message"], f"{where}.message", unmapped)
    if isinstance(outputs.get("output"), str):
        return message("assistant", outputs["output"])
    if isinstance(outputs.get("output"), dict):
        return any_message(outputs["output"], f"{where}.output", unmapped)
    raise FormatError(f"{where}: no choices, generations, message or output")


def _tool_output(outputs, where: str, unmapped: Counter) -> tuple[str | None, str]:
    """A tool run's result as text, and the tool call it answers when it says (LangChain's
    tools return a ToolMessage, which carries ``tool_call_id``)."""
    outputs = as_json(outputs, where)
    value = outputs.get("output", outputs) if isinstance(outputs, dict) else outputs
    if isinstance(value, dict) and ("lc" in value or value.get("type") == "tool"):
        reply = any_message(value, f"{where}.output", unmapped)
        return reply.get("tool_call_id"), reply["content"]
    if value is None or isinstance(value, str):
        return None, value or ""
    return None, json.dumps(value, ensure_ascii=False)


def _verdict(row, where: str, run_id: str | None) -> Verdict:
    """LangSmith feedback, its fields kept as they are (a true/false score as 1.0/0.0); the
    source is ``feedback_source.type`` (``api``, ``model``, ``app``)."""
    if not isinstance(row, dict):
        raise FormatError(f"{where or 'feedback'}: not an object")
    key = _text_field(row, "key", where)
    score = row.get("score")
    if score is not None and not isinstance(score, int | float):
        raise FormatError(f"{where}score: {score!r} is not a number")
    if isinstance(score, bool):  # LangSmith takes true/false; rows carry numbers
        score = float(score)
    source = row.get("feedback_source")
    kind = source.get("type") if isinstance(source, dict) else source
    entry = feedback(key, score, row.get("value"), row.get("comment"), row.get("correction"), kind)
    target = _optional_id(row, "run_id") or run_id
    return Verdict(_optional_id(row, "trace_id"), target, entry)
