"""The OpenAI-compatible endpoint: ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions``, beside the Tinker API and behind the same API key.

A request becomes one ``ops.Sample`` per prompt (``n`` rows each), so it shares the engine's
continuous-batching decode loop with Tinker ``asample`` requests: one arriving mid-decode joins
the running batch. ``stream: true`` answers server-sent events from that loop as tokens are
drawn (``SampleJob.stream``: the engine sends each step's tokens before the reply); a client
that goes away cancels its requests, and the engine drops their rows before its next step.
Errors, here and in ``app.py`` for every ``/v1`` path, have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``). ``model`` is the base model, a
``tinker://.../sampler_weights/...`` path the server holds, or an alias (``state/aliases.py``),
resolved once per request; the ``x-rlcli-checkpoint`` header names the checkpoint that answered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse

from rlcli import trace_format
from rlcli.server.engine import ops
from rlcli.server.engine.sample_job import SampleJob
from rlcli.server.http.openai import record, tool_parsers
from rlcli.server.http.openai.answers import Answer, Plan, Stream, whole
from rlcli.server.http.openai.schemas import ChatCompletion, Completion, OpenAIError
from rlcli.server.http.openai.text import ChatTokenizer, TextStream
from rlcli.server.http.tinker.sampling import _sampler_ref
from rlcli.server.http.tinker.validate import RequestError, check_token_ids
from rlcli.server.state.futures import Outcome
from rlcli.server.state.sessions import SamplerRef, ServerState, State
from rlcli.server.store import checkpoints

log = logging.getLogger("rlcli.server")

router = APIRouter(prefix="/v1")

CHECKPOINT_HEADER = "x-rlcli-checkpoint"  # the checkpoint that answered (an alias's, resolved)
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
            "id": alias["name"],
            "object": "model",
            "created": int(alias["updated"]),
            "owned_by": "rlcli",
            "root": alias["base_model"],
            "parent": alias["checkpoint"],
            "max_model_len": info["max_context"],
            "alias_version": alias["current"],
        }
        for alias in state.aliases.listing()
    ]
    out += [
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
        f"model: {model!r} is not served here (the base model {state.settings.base_model!r}, "
        "an alias or a tinker://.../sampler_weights/... path this server holds; GET /v1/models "
        "lists them)",
        "model",
        404,
        "model_not_found",
    )


def _resolve_model(state: ServerState, model: str) -> SamplerRef:
    """The checkpoint a request samples from, decided once: an alias is read here, so every
    row of the request uses the version it named when the request arrived."""
    version = state.aliases.resolve(model)
    if version is not None:
        try:
            return _resolve_served(state, version["checkpoint"])
        except OpenAIError as e:
            raise OpenAIError(
                f"model: alias {model!r} names {version['checkpoint']}, which this server no "
                f"longer holds ({e})", "model", 404, "model_not_found",
            ) from None  # fmt: skip
    return _resolve_served(state, model)


def _resolve_served(state: ServerState, model: str) -> SamplerRef:
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
        stop_at_eos=not body.ignore_eos,
    )


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletion, state: State):
    info, ref, text = await _accept(body, state)
    parser, forced = _tool_setup(body, text)
    prompt = text.chat_prompt(body.conversation(), body.tool_specs())
    if forced:
        prompt += text.encode(forced)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    cap = state.settings.max_sample_tokens
    job = _job(body, prompt, "messages", info, cap, body.limit, top)
    plan = Plan(
        "chat", body.model, [job], len(prompt), body.logprobs, top, body.stops, body.n,
        body.include_usage, tool_parser=parser, forced=forced,
    )  # fmt: skip
    return await _answer(state, ref, text, plan, record.recorder(state, body, ref))


def _tool_setup(body: ChatCompletion, text: ChatTokenizer):
    """The parser that reads this request's answer for tool calls (None: not read), and the
    text that starts the answer where ``tool_choice`` demands a call. A field that needs tools
    on a template without them is a 400 naming it."""
    field = body.uses_tools()
    if field and text.tool_parser is None:
        families = ", ".join(tool_parsers.PARSERS)
        raise OpenAIError(
            f"{field}: this model's chat template has no tool support (it renders no tools, or "
            f"writes calls in a format none of this server's parsers reads: {families})",
            field.split(".")[0] if field == "tools" else field,
        )
    if not body.calls_wanted:
        return None, ""
    parser = text.tool_parser
    if body.tool_choice == "required":
        return parser, parser.forced(None)
    if body.chosen_function:
        return parser, parser.forced(body.chosen_function)
    return parser, ""


@router.post("/completions")
async def completions(body: Completion, state: State):
    info, ref, text = await _accept(body, state)
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
    return await _answer(state, ref, text, plan, record.recorder(state, body, ref))


async def _accept(body: ChatCompletion | Completion, state: ServerState):
    """The checks both routes make first: what is refused, the model; then the tokenizer."""
    body.refusals()
    info = state.engine_info()
    return info, _resolve_model(state, body.model), await tokenizer(state)


async def _answer(state: ServerState, ref: SamplerRef, text: ChatTokenizer, plan: Plan, recorder):
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
    headers = {
        trace_format.TRACE_ID_HEADER: plan.trace_id,
        CHECKPOINT_HEADER: ref.model_path or ref.base_model,
    }
    if plan.jobs[0].stream:
        answer = Answer(plan, text, choices, request_ids)

        def closed() -> None:
            answer.close(state)
            if recorder is not None:
                recorder(plan, answer.results(), answer.status)

        return Stream(answer.events(events), on_close=closed, headers=headers)
    outputs = []
    for request_id in request_ids:
        outputs.append(_result(await _wait(state, request_id)))
    response = whole(plan, text, choices, outputs)
    if recorder is not None:
        recorder(plan, plan.results, "ok")
    return JSONResponse(response, headers=headers)


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
