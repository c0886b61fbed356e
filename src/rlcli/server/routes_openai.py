"""The OpenAI-compatible endpoint: ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions``, beside the Tinker API and behind the same API key.

A request becomes one ``ops.Sample`` per prompt (``n`` rows each), so it shares the engine's
continuous-batching decode loop with Tinker ``asample`` requests: one arriving mid-decode joins
the running batch. ``stream: true`` answers server-sent events from that loop as tokens are
drawn (``SampleJob.stream``: the engine sends each step's tokens before the reply); a client
that goes away cancels its requests, and the engine drops their rows before its next step.
Errors, here and in ``app.py`` for every ``/v1`` path, have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``). ``model`` is the base model or a
``tinker://.../sampler_weights/...`` path the server holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException
from fastapi.responses import StreamingResponse

from rlcli.server import checkpoints, ops
from rlcli.server.futures import Outcome
from rlcli.server.openai_schemas import ChatCompletion, Completion, OpenAIError
from rlcli.server.openai_text import ChatTokenizer, TextStream
from rlcli.server.routes_sampling import _sampler_ref
from rlcli.server.sampling import SampleJob
from rlcli.server.state import SamplerRef, ServerState, State
from rlcli.server.validate import RequestError, check_token_ids

log = logging.getLogger("rlcli.server")

router = APIRouter(prefix="/v1")

POLL_S = 30.0  # a non-streaming answer is awaited in windows of this (it never times out)


# ---- models -------------------------------------------------------------------------------


@router.get("/models")
async def list_models(state: State):
    return {"object": "list", "data": await _models(state)}


@router.get("/models/{model:path}")
async def get_model(model: str, state: State):
    for entry in await _models(state):
        if entry["id"] == model:
            return entry
    raise _unknown_model(state, model)


async def _models(state: ServerState) -> list[dict[str, Any]]:
    info = state.engine_info()
    text = await tokenizer(state)
    base = state.settings.base_model
    out = [
        {
            "id": base,
            "object": "model",
            "created": int(state.started),
            "owned_by": "rlcli",
            "root": base,
            "parent": None,
            "max_model_len": info["max_context"],
            "chat_template": text.metadata(),
        }
    ]
    for run in checkpoints.list_runs(state.checkpoints_root):
        for meta in checkpoints.list_checkpoints(state.checkpoints_root, run["training_run_id"]):
            if meta.get("checkpoint_type") != "sampler":
                continue
            out.append(
                {
                    "id": meta["tinker_path"],
                    "object": "model",
                    "created": int(meta.get("created") or 0),
                    "owned_by": "rlcli",
                    "root": run.get("base_model", base),
                    "parent": run.get("base_model", base),
                    "max_model_len": info["max_context"],
                }
            )
    return out


def _unknown_model(state: ServerState, model: str) -> OpenAIError:
    return OpenAIError(
        f"model: {model!r} is not served here (the base model {state.settings.base_model!r} or "
        "a tinker://.../sampler_weights/... path this server holds; GET /v1/models lists them)",
        "model",
        404,
        "model_not_found",
    )


def _resolve_model(state: ServerState, model: str) -> SamplerRef:
    if model.startswith("tinker://"):
        try:
            return _sampler_ref(state, model, None, None)
        except HTTPException as e:
            if e.status_code == 404:
                raise _unknown_model(state, model) from None
            raise OpenAIError(f"model: {e.detail}", "model", e.status_code) from None
        except OpenAIError:
            raise
        except Exception as e:  # a malformed tinker:// path
            raise OpenAIError(f"model: {e}", "model") from None
    if not state.accepts_base_model(model):
        raise _unknown_model(state, model)
    return _sampler_ref(state, None, state.settings.base_model, None)


async def tokenizer(state: ServerState) -> ChatTokenizer:
    """The base model's tokenizer, loaded once (in a thread: the event loop keeps serving)."""
    if state.chat_tokenizer is not None:
        return state.chat_tokenizer
    async with state.chat_tokenizer_lock:
        if state.chat_tokenizer is None:
            eos = state.engine_info().get("eos_ids", [])
            state.chat_tokenizer = await asyncio.to_thread(
                ChatTokenizer, state.settings.base_model, eos
            )
    return state.chat_tokenizer


# ---- requests -> sample jobs --------------------------------------------------------------


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
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _job(
    body, prompt: list[int], where: str, info: dict, cap: int, limit: int | None, top: int
) -> SampleJob:
    """Check one prompt against the model and the server's caps (400 naming the field)."""
    if not prompt:
        raise OpenAIError(f"{where}: empty; nothing to complete", where)
    ids = np.asarray(prompt, dtype=np.int64)
    try:
        check_token_ids(ids, info["vocab_size"], where)
    except RequestError as e:
        raise OpenAIError(str(e), where) from None
    context = info["max_context"]
    room = context - len(prompt)
    if room < 1:
        raise OpenAIError(
            f"{where}: {len(prompt)} tokens; the model's context is {context}, leaving no room "
            "for a completion",
            where,
            code="context_length_exceeded",
        )
    name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    if limit is not None and limit > cap:
        raise OpenAIError(
            f"{name}: {limit} is above this server's limit of {cap} "
            "(`rlcli serve start --max-sample-tokens N`)",
            name,
        )
    if limit is not None and limit > room:
        raise OpenAIError(
            f"{name}: {limit} + a {len(prompt)}-token prompt exceeds the model's context of "
            f"{context}",
            name,
            code="context_length_exceeded",
        )
    stop_tokens = list(body.stop_token_ids or [])
    if stop_tokens:
        try:
            check_token_ids(np.asarray(stop_tokens), info["vocab_size"], "stop_token_ids")
        except RequestError as e:
            raise OpenAIError(str(e), "stop_token_ids") from None
    seed = None if body.seed is None else body.seed % 2**64
    return SampleJob(
        prompt=ids,
        num_samples=body.n,
        max_tokens=min(room, cap) if limit is None else limit,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=seed,
        stop_strings=body.stops,
        stop_tokens=stop_tokens,
        topk_sample_logprobs=top,
        stream=body.stream,
    )


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletion, state: State):
    body.refusals()
    info = state.engine_info()
    ref = _resolve_model(state, body.model)
    text = await tokenizer(state)
    prompt = text.chat_prompt(body.conversation())
    top = (body.top_logprobs or 0) if body.logprobs else 0
    cap = state.settings.max_sample_tokens
    job = _job(body, prompt, "messages", info, cap, body.limit, top)
    plan = Plan(
        "chat", body.model, [job], len(prompt), body.logprobs, top, body.stops, body.n,
        body.include_usage,
    )  # fmt: skip
    return await _answer(state, ref, text, plan)


@router.post("/completions")
async def completions(body: Completion, state: State):
    body.refusals()
    info = state.engine_info()
    ref = _resolve_model(state, body.model)
    text = await tokenizer(state)
    prompts = body.prompts()
    jobs, counted = [], 0
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        ids = text.encode(prompt) if isinstance(prompt, str) else prompt
        jobs.append(
            _job(body, ids, where, info, state.settings.max_sample_tokens, body.max_tokens,
                 body.logprobs or 0)
        )  # fmt: skip
        counted += len(ids)
    plan = Plan(
        "text", body.model, jobs, counted, body.logprobs is not None, body.logprobs or 0,
        body.stops, body.n, body.include_usage,
    )  # fmt: skip
    return await _answer(state, ref, text, plan)


async def _answer(state: ServerState, ref: SamplerRef, text: ChatTokenizer, plan: Plan):
    events: asyncio.Queue = asyncio.Queue()
    request_ids = []
    for job in plan.jobs:
        job.sampler = ref.key
        request_id = state.submit(ops.Sample(job))["request_id"]
        if job.stream:
            state.futures.listen(request_id, events)
        request_ids.append(request_id)
    ends = text.eos_ids | frozenset(plan.jobs[0].stop_tokens)  # tokens that end, not text
    choices = [TextStream(text.decode, plan.stops, ends) for _ in range(len(plan.jobs) * plan.n)]
    if plan.jobs[0].stream:
        answer = _Answer(plan, text, choices, request_ids)
        return _Stream(answer.events(events), on_close=lambda: answer.close(state))
    outputs = []
    for request_id in request_ids:
        outputs.append(_result(await _wait(state, request_id)))
    return _whole(plan, text, choices, outputs)


async def _wait(state: ServerState, request_id: str) -> Outcome:
    while True:
        outcome = await state.futures.wait(request_id, POLL_S)
        if outcome is not None:
            return outcome


def _result(outcome: Outcome):
    if outcome.status == "ok":
        return outcome.value
    if outcome.status == "user":
        raise OpenAIError(str(outcome.value))
    raise OpenAIError(f"sampling failed: {outcome.value}", status=500, code="server_error")


# ---- answers ------------------------------------------------------------------------------


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


def _whole(plan: Plan, text: ChatTokenizer, choices: list[TextStream], outputs) -> dict:
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
                message = {"role": "assistant", "content": stream.text, "refusal": None}
                out.append({"index": index, "message": message, "finish_reason": finish,
                            "logprobs": _logprobs_json(plan, entries, 0)})  # fmt: skip
            else:
                out.append({"index": index, "text": stream.text, "finish_reason": finish,
                            "logprobs": _logprobs_json(plan, entries, 0)})  # fmt: skip
    return {
        "id": ("chatcmpl-" if plan.kind == "chat" else "cmpl-") + plan.id,
        "object": "chat.completion" if plan.kind == "chat" else "text_completion",
        "created": plan.created,
        "model": plan.model,
        "system_fingerprint": None,
        "choices": out,
        "usage": _usage(plan, choices),
    }


class _Stream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (finished, the client
    gone, an error), so an abandoned request never keeps its rows in the batch."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _Answer:
    """One streaming request: the engine's partial results and replies -> SSE chunks."""

    def __init__(self, plan: Plan, text: ChatTokenizer, choices, request_ids: list[str]) -> None:
        self.plan, self.text, self.choices = plan, text, choices
        self.prompt_of = {rid: p for p, rid in enumerate(request_ids)}
        self.open = set(request_ids)  # requests not yet answered by the engine
        self.finished: set[int] = set()  # choices whose finish_reason was sent
        self.offsets = [0] * len(choices)

    def close(self, state: ServerState) -> None:
        for request_id in self.open:
            state.engine.cancel(request_id)
            log.info("stream %s: client gone; its rows leave the batch", request_id)
        self.open.clear()

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        plan = self.plan
        chunk = {
            "id": ("chatcmpl-" if plan.kind == "chat" else "cmpl-") + plan.id,
            "object": "chat.completion.chunk" if plan.kind == "chat" else "text_completion",
            "created": plan.created,
            "model": plan.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if plan.include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    def _choice(self, index: int, delta: str, entries: list[dict], finish: str | None) -> dict:
        logprobs = _logprobs_json(self.plan, entries, self.offsets[index]) if entries else None
        self.offsets[index] += len(delta)
        if self.plan.kind == "chat":
            body = {"content": delta} if delta or finish is None else {}
            return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}

    def _push(self, index: int, token: int, logprob: float, top, reason) -> tuple[str, list]:
        stream = self.choices[index]
        delta, is_text = stream.push(token, reason)
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
                    return  # on_close cancels the rest
                chunk = self._final(prompt, item.value)
            if chunk:
                yield chunk
        if self.plan.include_usage:
            yield self._chunk([], _usage(self.plan, self.choices))
        yield "data: [DONE]\n\n"
