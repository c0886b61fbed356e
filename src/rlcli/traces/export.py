"""Captured traces -> the rows the train commands read:

- ``sft`` (``train sl``): the conversation with the model's answer, for each trace whose
  verdict scored at least ``min_score``; and, for each correction, the conversation with the
  correction as the answer instead.
- ``dpo`` (``train dpo``): ``{"chosen", "rejected"}`` conversations, the correction against the
  answer it corrected.
- ``judged`` (``rlcli learn --traces``, ``rlcli redact``, anything that reads import rows):
  every trace with a verdict, as the conversation ending in the answer it judged.
- ``prompts`` (``train rl --dataset ... --reward``): the question, the conversation before the
  answer, the recorded tool outputs and the verdicts, and the correction as ``answer`` where
  there is one.

Rows are the import row (docs/imports-and-redaction.md): ``messages`` in the chat API's shape
(content always text, tool-call arguments JSON strings), ``tools``, ``feedback``, ``origin``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rlcli.data.chat import content_text

KINDS = ("sft", "dpo", "prompts", "judged")


def conversation(trace: dict) -> list[dict] | None:
    """The request's messages in the row's shape (None: not a chat exchange)."""
    messages = trace.get("messages")
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        role = "system" if m.get("role") == "developer" else m.get("role")
        turn: dict[str, Any] = {"role": role, "content": content_text(m.get("content")) or ""}
        if m.get("tool_calls"):
            turn["tool_calls"] = m["tool_calls"]
        if m.get("tool_call_id"):
            turn["tool_call_id"] = m["tool_call_id"]
        out.append(turn)
    return out


def answer(trace: dict) -> dict | None:
    """The first choice's message (None: the exchange did not finish)."""
    if trace.get("status") != "ok" or not trace.get("choices"):
        return None
    message = trace["choices"][0].get("message")
    if message is None:
        return None
    turn = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return turn


def correction_text(verdict: dict) -> str | None:
    """A correction as the answer's text: a string, or LangSmith's ``{"outputs": ...}`` /
    ``{"content"|"text"|"answer": ...}`` objects."""
    value = verdict.get("correction")
    for _ in range(3):
        if isinstance(value, str):
            return value if value.strip() else None
        if not isinstance(value, dict):
            return None
        value = next((value[k] for k in ("content", "text", "answer", "output", "outputs",
                                         "message") if k in value), None)  # fmt: skip
    return None


def _row(trace: dict, messages: list[dict], kind: str) -> dict:
    return {
        "messages": messages,
        **({"tools": trace["tools"]} if trace.get("tools") else {}),
        "feedback": [_verdict(v) for v in trace["feedback"]],
        "origin": {"format": "rlcli-capture", "trace_id": trace.get("id"), "kind": kind,
                   "model": trace.get("model"), "checkpoint": trace.get("checkpoint")},
    }  # fmt: skip


def _verdict(v: dict) -> dict:
    keys = ("key", "score", "value", "comment", "correction", "source")
    return {k: v.get(k) for k in keys}


def rows(
    traces: list[dict], kind: str, *, min_score: float = 1.0, key: str | None = None
) -> tuple[list[dict], Counter]:
    """The rows of ``kind`` and a count of the traces skipped, by reason."""
    skipped: Counter = Counter()
    out = []
    for trace in traces:
        prompt, said = conversation(trace), answer(trace)
        if prompt is None or said is None:
            skipped["not a finished chat exchange"] += 1
            continue
        verdicts = [v for v in trace["feedback"] if key is None or v.get("key") == key]
        fixes = [text for v in verdicts if (text := correction_text(v))]
        made = 0
        if kind == "sft":
            scores = [v["score"] for v in verdicts if isinstance(v.get("score"), int | float)]
            if scores and max(scores) >= min_score and said["content"].strip():
                out.append(_row(trace, [*prompt, said], "answer"))
                made += 1
            for text in fixes:
                out.append(_row(trace, [*prompt, {"role": "assistant", "content": text}],
                                "correction"))  # fmt: skip
                made += 1
        elif kind == "dpo":
            for text in fixes:
                if text.strip() == said["content"].strip():
                    continue
                row = _row(trace, [], "correction")
                del row["messages"]
                chosen = [*prompt, {"role": "assistant", "content": text}]
                rejected = [*prompt, {"role": "assistant", "content": said["content"]}]
                out.append({"chosen": chosen, "rejected": rejected, **row})
                made += 1
        elif kind == "judged":
            if trace["feedback"]:
                out.append(_row(trace, [*prompt, said], "judged"))
                made += 1
        elif kind == "prompts":
            question = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
            if question.strip():
                row = _row(trace, prompt, "prompt")
                row.update(
                    id=trace.get("id"), question=question, recorded_answer=said["content"],
                    tool_outputs=[m["content"] for m in prompt if m["role"] == "tool"],
                )  # fmt: skip
                if fixes:
                    row["answer"] = fixes[-1]
                out.append(row)
                made += 1
        else:
            raise ValueError(kind)
        if not made:
            skipped[_why_not(kind, verdicts, fixes)] += 1
    return out, skipped


def _why_not(kind: str, verdicts: list, fixes: list) -> str:
    if kind == "prompts":
        return "no user question"
    if kind == "judged":
        return "no verdict"
    if kind == "dpo":
        return "no correction" if not fixes else "the correction equals the answer"
    return "no verdict at or above --min-score and no correction" if verdicts else "no verdict"
