"""One ``/v1`` exchange as a capture record (``server/state/capture.py`` writes it; the fields
are docs/traces.md's): what was asked, by which name, which checkpoint answered, the answer
with its token ids and the sampler's logprobs, and how long it took."""

from __future__ import annotations

import time
from collections.abc import Callable

from rlcli import trace_format
from rlcli.server.http.openai.answers import Plan
from rlcli.server.http.openai.schemas import ChatCompletion, Completion
from rlcli.server.state.sessions import SamplerRef, ServerState


def recorder(
    state: ServerState, body: ChatCompletion | Completion, ref: SamplerRef
) -> Callable[[Plan, list[dict], str], None] | None:
    """A function that queues the record of this request's answer (None: capture is off)."""
    capture = state.capture
    if capture is None:
        return None
    asked = _asked(body)

    def record(plan: Plan, results: list[dict], status: str) -> None:
        capture.trace(
            {
                "v": trace_format.VERSION,
                "id": plan.trace_id,
                "time": _iso(time.time() - (time.monotonic() - plan.started)),
                "endpoint": "chat.completions" if plan.kind == "chat" else "completions",
                "model": body.model,
                "checkpoint": ref.model_path,  # null: the base model answered
                "base_model": ref.base_model,
                **asked,
                "params": _params(body),
                "prompt_token_ids": [job.prompt.tolist() for job in plan.jobs],
                "choices": results,
                "latency_s": round(time.monotonic() - plan.started, 6),
                "status": status,
            }
        )

    return record


def _asked(body: ChatCompletion | Completion) -> dict:
    if isinstance(body, ChatCompletion):
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice
        return {
            "messages": [m.model_dump(exclude_none=True) for m in body.messages],
            "tools": tools,
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else choice,
        }
    return {"prompt": body.prompt}


def _params(body: ChatCompletion | Completion) -> dict:
    limit = body.limit if isinstance(body, ChatCompletion) else body.max_tokens
    return {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_tokens": limit,
        "n": body.n,
        "seed": body.seed,
        "stop": body.stops,
        "stream": body.stream,
    }


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def tinker_sample(state: ServerState, request_id: str, ref: SamplerRef, job, started: float):
    """``--capture-tinker``: the record of an ``asample`` once the engine answers."""
    capture = state.capture

    def record(outcome) -> None:
        if outcome.status != "ok":
            return
        choices = [
            {"index": i, "finish_reason": reason, "token_ids": tokens.tolist(),
             "logprobs": logprobs.tolist()}
            for i, (tokens, logprobs, reason) in enumerate(outcome.value.sequences)
        ]  # fmt: skip
        capture.trace(
            {
                "v": trace_format.VERSION,
                "id": request_id,
                "time": _iso(time.time() - (time.monotonic() - started)),
                "endpoint": "tinker.sample",
                "model": ref.model_path or ref.base_model,
                "checkpoint": ref.model_path,
                "base_model": ref.base_model,
                "params": {
                    "temperature": job.temperature,
                    "top_p": job.top_p,
                    "max_tokens": job.max_tokens,
                    "n": job.num_samples,
                    "seed": job.seed,
                    "stop": list(job.stop_strings or []) or list(job.stop_tokens or []),
                },  # fmt: skip
                "prompt_token_ids": [job.prompt.tolist()],
                "choices": choices,
                "latency_s": round(time.monotonic() - started, 6),
                "status": "ok",
            }
        )

    return record
