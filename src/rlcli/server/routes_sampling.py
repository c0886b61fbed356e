"""Sampling routes: sampling sessions (a base model or saved sampler weights) and ``asample``."""

from __future__ import annotations

import uuid

import numpy as np
from fastapi import APIRouter, HTTPException

from rlcli.server import checkpoints, ops
from rlcli.server.routes_checkpoints import resolve_checkpoint
from rlcli.server.sampling import SampleJob
from rlcli.server.schemas import CreateSamplingSession, Sample
from rlcli.server.state import SamplerRef, ServerState, State
from rlcli.server.validate import RequestError, check_token_ids

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(body: CreateSamplingSession, state: State):
    state.session(body.session_id)
    ref = _sampler_ref(state, body.model_path, body.base_model, body.session_id)
    sampler_id = f"sampler-{uuid.uuid4()}"
    state.add_sampling_session(sampler_id, ref)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, state: State):
    ref = state.sampling_sessions.get(sampler_id)
    if ref is None:
        raise HTTPException(404, f"sampler_id: unknown sampler {sampler_id!r}")
    return {"sampler_id": sampler_id, "base_model": ref.base_model, "model_path": ref.model_path}


@router.post("/asample")
async def asample(body: Sample, state: State):
    info = state.engine_info()
    if body.sampling_session_id:
        ref = state.sampling_sessions.get(body.sampling_session_id)
        if ref is None:
            raise HTTPException(
                404, f"sampling_session_id: unknown session {body.sampling_session_id!r}"
            )
    else:
        ref = _sampler_ref(state, body.model_path, body.base_model, None)
    job = _sample_job(body, info, state.settings.max_sample_tokens)
    job.sampler = ref.key
    return state.submit(ops.Sample(job))


def _sampler_ref(
    state: ServerState, model_path: str | None, base_model: str | None, session_id: str | None
) -> SamplerRef:
    if model_path:
        ref, folder = resolve_checkpoint(state, model_path)
        run = checkpoints.read_run(state.checkpoints_root, ref.run_id) or {}
        base = run.get("base_model", state.settings.base_model)
        return SamplerRef(str(folder), base, session_id, model_path)
    state.check_base_model(base_model)
    return SamplerRef(None, state.settings.base_model, session_id)


def _sample_job(body: Sample, info: dict, max_sample_tokens: int) -> SampleJob:
    tokens = [t for chunk in body.prompt.chunks for t in chunk.tokens]
    for j, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text":
            raise RequestError(
                f"prompt.chunks[{j}]: {chunk.type} chunks are not supported (text tokens only)"
            )
    prompt = np.asarray(tokens, dtype=np.int64)
    if prompt.size == 0:
        raise RequestError("prompt: empty; send at least one token")
    check_token_ids(prompt, info["vocab_size"], "prompt")
    params = body.sampling_params
    room = info["max_context"] - len(prompt)
    if room < 0:
        raise RequestError(
            f"prompt: {len(prompt)} tokens exceeds the model's context of {info['max_context']}"
        )
    max_tokens = min(room, max_sample_tokens) if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise RequestError(
            f"sampling_params.max_tokens: {max_tokens} + a {len(prompt)}-token prompt exceeds "
            f"the model's context of {info['max_context']}"
        )
    if max_tokens > max_sample_tokens:
        raise RequestError(
            f"sampling_params.max_tokens: {max_tokens} is above this server's limit of "
            f"{max_sample_tokens} (`rlcli serve start --max-sample-tokens N`)"
        )
    stop_tokens: list[int] = []
    stop_strings: list[str] = []
    if isinstance(params.stop, str):
        stop_strings = [params.stop]
    elif params.stop and isinstance(params.stop[0], str):
        stop_strings = list(params.stop)
    elif params.stop:
        stop_tokens = list(params.stop)
        check_token_ids(np.asarray(stop_tokens), info["vocab_size"], "sampling_params.stop")
    if len(stop_strings) > 64 or any(len(s) > 1024 for s in stop_strings):
        raise RequestError("sampling_params.stop: at most 64 strings of at most 1024 characters")
    return SampleJob(
        prompt=prompt,
        num_samples=body.num_samples,
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop_tokens=stop_tokens,
        stop_strings=[s for s in stop_strings if s],
        prompt_logprobs=bool(body.prompt_logprobs),
        topk_prompt_logprobs=body.topk_prompt_logprobs,
    )
