"""The answers of the OpenAI-compatible endpoint (``routes.py``): a whole
``chat.completion`` / ``text_completion`` from the engine's ``SampleOutput``, and the SSE chunks
of a stream from the engine's partial results (``_Answer``), one ``TextStream`` per choice.
``Stream`` runs its ``on_close`` however the response ends, which is how a client that hangs
up cancels its rows. With tools, each choice's text also goes through a ``ToolText``: content
streams until a tool call starts, each call is sent whole once it is complete, and a choice
that made calls finishes with ``tool_calls``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from rlcli.server.engine.sample_job import SampleJob
from rlcli.server.http.openai.text import ChatTokenizer, TextStream
from rlcli.server.http.openai.tool_parsers import ToolCall, ToolParser, ToolText
from rlcli.server.state.futures import Outcome
from rlcli.server.state.sessions import ServerState

log = logging.getLogger("rlcli.server")


@dataclass
class Plan:
    """One OpenAI request as engine jobs: one per prompt, ``n`` rows each."""

    kind: str  # "chat" | "text"
    model: str
    jobs: list[SampleJob]
    prompt_tokens: int
    logprobs: bool
    top_logprobs: int
    stops: list[str]
    n: int
    include_usage: bool = False
    tool_parser: ToolParser | None = None  # reads tool calls back (None: tools not asked for)
    forced: str = ""  # text the prompt ends with that is the answer's start (tool_choice)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    results: list[dict] = field(default_factory=list)  # each choice as captured (capture.py)

    @property
    def trace_id(self) -> str:
        """The answer's ``id``, which is also its trace's (``x-rlcli-trace-id``)."""
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id


def _token_entry(text: ChatTokenizer, token: int, logprob: float, top, kind: str):
    """One token's logprobs entry, in the chat shape (the text shape is built from these)."""
    piece = text.decode([token])
    entry = {"token": piece, "logprob": float(logprob), "bytes": list(piece.encode())}
    alternatives = []
    for alt, alt_lp in zip(*top, strict=True) if top and top[0] is not None else ():
        alt_piece = text.decode([int(alt)])
        alternatives.append(
            {"token": alt_piece, "logprob": float(alt_lp), "bytes": list(alt_piece.encode())}
        )
    entry["top_logprobs"] = alternatives
    return entry


def _logprobs_json(plan: Plan, entries: list[dict], offset: int) -> dict | None:
    if not plan.logprobs:
        return None
    if plan.kind == "chat":
        return {"content": entries, "refusal": None}
    offsets, at = [], offset
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {a["token"]: a["logprob"] for a in e["top_logprobs"]} if plan.top_logprobs else None
            for e in entries
        ],
        "text_offset": offsets,
    }


def _usage(plan: Plan, choices: list[TextStream]) -> dict[str, int]:
    completion = sum(c.drawn for c in choices)
    return {
        "prompt_tokens": plan.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": plan.prompt_tokens + completion,
    }


def tool_texts(plan: Plan, count: int) -> list[ToolText | None]:
    """One ``ToolText`` per choice where the answer is read for tool calls."""
    if plan.tool_parser is None:
        return [None] * count
    return [ToolText(plan.tool_parser, plan.forced) for _ in range(count)]


def finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _call_deltas(calls: list[ToolCall], first: int) -> list[dict]:
    return [{"index": first + k, **call.openai()} for k, call in enumerate(calls)]


def _result(plan: Plan, index: int, body: dict, finish, tokens: list, logprobs: list) -> dict:
    """One choice as a capture record keeps it: the answer, its tokens and their logprobs."""
    out: dict = {"index": index}
    if plan.kind == "chat":
        out["message"] = {"role": "assistant", "content": body.get("content") or ""}
        if body.get("tool_calls"):
            out["message"]["tool_calls"] = body["tool_calls"]
    else:
        out["text"] = body.get("text", "")
    out.update(finish_reason=finish, token_ids=tokens, logprobs=logprobs)
    return out


def whole(plan: Plan, text: ChatTokenizer, choices: list[TextStream], outputs) -> dict:
    """The non-streaming answer from the engine's ``SampleOutput`` per prompt."""
    out = []
    for p, output in enumerate(outputs):
        for s, (tokens, logprobs, reason) in enumerate(output.sequences):
            index = p * plan.n + s
            stream = choices[index]
            entries = []
            pairs = zip(tokens.tolist(), logprobs.tolist(), strict=True)
            for t, (token, logprob) in enumerate(pairs):
                last = t == len(tokens) - 1
                _, is_text = stream.push(token, reason if last else None)
                if is_text and plan.logprobs:
                    top = None
                    if output.topk_sampled is not None and plan.top_logprobs:
                        ids, lps = output.topk_sampled[s]
                        k = plan.top_logprobs
                        top = (ids[t, :k].tolist(), lps[t, :k].tolist())
                    entries.append(_token_entry(text, token, logprob, top, plan.kind))
            if not len(tokens):
                stream.finish_reason = reason
            finish = stream.finish_reason or reason
            if plan.kind == "chat":
                content, calls = stream.text, []
                if plan.tool_parser is not None:
                    tools = ToolText(plan.tool_parser, plan.forced)
                    content, calls = tools.push(stream.text, final=True)
                message = {"role": "assistant", "content": content, "refusal": None}
                if calls:
                    message["content"] = content or None
                    message["tool_calls"] = [call.openai() for call in calls]
                finish = finish_reason(finish, calls)
                out.append({"index": index, "message": message, "finish_reason": finish,
                            "logprobs": _logprobs_json(plan, entries, 0)})  # fmt: skip
            else:
                out.append({"index": index, "text": stream.text, "finish_reason": finish,
                            "logprobs": _logprobs_json(plan, entries, 0)})  # fmt: skip
            answer = out[-1].get("message", out[-1])
            plan.results.append(
                _result(plan, index, answer, finish, tokens.tolist(), logprobs.tolist())
            )
    kind = "chat.completion" if plan.kind == "chat" else "text_completion"
    return {**_envelope(plan, kind), "choices": out, "usage": _usage(plan, choices)}


def _envelope(plan: Plan, kind: str) -> dict:
    """The fields every answer and every chunk of one request share."""
    return {
        "id": ("chatcmpl-" if plan.kind == "chat" else "cmpl-") + plan.id,
        "object": kind,
        "created": plan.created,
        "model": plan.model,
        "system_fingerprint": None,
    }


class Stream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (finished, the client
    gone, an error), so an abandoned request never keeps its rows in the batch."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Answer:
    """One streaming request: the engine's partial results and replies -> SSE chunks."""

    def __init__(self, plan: Plan, text: ChatTokenizer, choices, request_ids: list[str]) -> None:
        self.plan, self.text, self.choices = plan, text, choices
        self.prompt_of = {rid: p for p, rid in enumerate(request_ids)}
        self.open = set(request_ids)  # requests not yet answered by the engine
        self.finished: set[int] = set()  # choices whose finish_reason was sent
        self.offsets = [0] * len(choices)
        self.tools = tool_texts(plan, len(choices))
        self.token_ids: list[list[int]] = [[] for _ in choices]
        self.logprobs: list[list[float]] = [[] for _ in choices]
        self.reasons: list[str | None] = [None] * len(choices)
        self.status = "cancelled"  # until the last event is sent: "ok", or "error"

    def close(self, state: ServerState) -> None:
        for request_id in self.open:
            state.engine.cancel(request_id)
            log.info("stream %s: client gone; its rows leave the batch", request_id)
        self.open.clear()

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        plan = self.plan
        kind = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
        chunk = {**_envelope(plan, kind), "choices": choices}
        if plan.include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    def _choice(self, index: int, delta: str, entries: list[dict], finish: str | None) -> dict:
        logprobs = _logprobs_json(self.plan, entries, self.offsets[index]) if entries else None
        self.offsets[index] += len(delta)
        if self.plan.kind == "chat":
            calls, tools = [], self.tools[index]
            if tools is not None:
                first = len(tools.emitted)
                delta, calls = tools.push(delta, final=finish is not None)
                finish = finish_reason(finish, tools.emitted)
            body = {"content": delta} if delta or (finish is None and not calls) else {}
            if calls:
                body["tool_calls"] = _call_deltas(calls, first)
            self.reasons[index] = finish
            return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        self.reasons[index] = finish
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}

    def results(self) -> list[dict]:
        """Each choice as far as it got, for the capture record."""
        out = []
        for index, stream in enumerate(self.choices):
            tools = self.tools[index]
            body = {"text": stream.text, "content": stream.text}
            if tools is not None:
                body["content"] = tools.content
                body["tool_calls"] = [call.openai() for call in tools.emitted]
            reason = self.reasons[index]
            out.append(
                _result(self.plan, index, body, reason, self.token_ids[index], self.logprobs[index])
            )
        return out

    def _push(self, index: int, token: int, logprob: float, top, reason) -> tuple[str, list]:
        stream = self.choices[index]
        delta, is_text = stream.push(token, reason)
        self.token_ids[index].append(int(token))
        self.logprobs[index].append(float(logprob))
        entries = []
        if is_text and self.plan.logprobs:
            k = self.plan.top_logprobs
            cut = (top[0][:k], top[1][:k]) if k and top[0] is not None else None
            entries.append(_token_entry(self.text, token, logprob, cut, self.plan.kind))
        return delta, entries

    def _step(self, prompt: int, tokens: list[tuple]) -> str:
        """One decode step's tokens of one request -> one chunk (the choices that changed)."""
        grouped: dict[int, tuple[str, list]] = {}
        for sample, token, logprob, top_ids, top_lps, reason in tokens:
            index = prompt * self.plan.n + sample
            if index in self.finished:
                continue
            delta, entries = self._push(index, token, logprob, (top_ids, top_lps), reason)
            text, got = grouped.get(index, ("", []))
            grouped[index] = (text + delta, got + entries)
        out = []
        for index, (delta, entries) in grouped.items():
            finish = self.choices[index].finish_reason
            if finish:
                self.finished.add(index)
            if delta or entries or finish:
                out.append(self._choice(index, delta, entries, finish))
        return self._chunk(out) if out else ""

    def _final(self, prompt: int, output) -> str:
        """The engine's reply: tokens not streamed yet (a batch retried alone, max_tokens 0)
        and every finish_reason not sent yet."""
        out = []
        for s, (tokens, logprobs, reason) in enumerate(output.sequences):
            index = prompt * self.plan.n + s
            if index in self.finished:
                continue
            stream = self.choices[index]
            delta, entries = "", []
            for t in range(stream.drawn, len(tokens)):
                top = (None, None)
                if output.topk_sampled is not None:
                    ids, lps = output.topk_sampled[s]
                    top = (ids[t].tolist(), lps[t].tolist())
                last = t == len(tokens) - 1
                d, e = self._push(index, int(tokens[t]), float(logprobs[t]), top,
                                  reason if last else None)  # fmt: skip
                delta, entries = delta + d, entries + e
            self.finished.add(index)
            out.append(self._choice(index, delta, entries, stream.finish_reason or reason))
        return self._chunk(out) if out else ""

    def _error(self, message: str, status: int) -> str:
        kind = "invalid_request_error" if status < 500 else "server_error"
        error = {"message": message, "type": kind, "param": None, "code": None}
        return f"data: {json.dumps({'error': error})}\n\n"

    async def events(self, queue: asyncio.Queue) -> AsyncIterator[str]:
        if self.plan.kind == "chat":  # the role first, as OpenAI sends it
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
                for i in range(len(self.choices))
            ]  # fmt: skip
            yield self._chunk(first)
        while self.open:
            request_id, item = await queue.get()
            prompt = self.prompt_of[request_id]
            if not isinstance(item, Outcome):
                chunk = self._step(prompt, item)
            else:
                self.open.discard(request_id)
                if item.status != "ok":
                    log.info("stream %s failed: %s", request_id, item.value)
                    status = 400 if item.status == "user" else 500
                    yield self._error(f"sampling failed: {item.value}", status)
                    self.status = "error"
                    return  # on_close cancels the rest
                chunk = self._final(prompt, item.value)
            if chunk:
                yield chunk
        if self.plan.include_usage:
            yield self._chunk([], _usage(self.plan, self.choices))
        self.status = "ok"
        yield "data: [DONE]\n\n"
