"""Sampling routes: sampling sessions (a base model or saved sampler weights) and ``asample``."""

from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi import APIRouter, HTTPException

from rlcli.server.engine import ops
from rlcli.server.engine.sample_job import SampleJob
from rlcli.server.http.openai import record
from rlcli.server.http.tinker import generations
from rlcli.server.http.tinker.checkpoints import resolve_checkpoint
from rlcli.server.http.tinker.schemas import CreateSamplingSession, Sample, TensorData
from rlcli.server.http.tinker.validate import RequestError, check_token_ids
from rlcli.server.state.sessions import SamplerRef, ServerState, State
from rlcli.server.store import checkpoints

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
    session = state.session_of_sampler(ref)
    version = session.sdk_version if session else None
    for name in generations.NEW_SAMPLE_FIELDS:
        refusal = generations.needs_current(name, version) if getattr(body, name) else None
        if refusal:
            raise HTTPException(400, refusal)
    job = _sample_job(body, info, state.settings.max_sample_tokens)
    if body.sampling_params.stop == [] and not generations.is_legacy(version):
        job.stop_at_eos = False  # tinker>=0.38: `stop=[]` disables every stop, EOS too
    job.sampler = ref.key
    started = time.monotonic()
    future = state.submit(ops.Sample(job))
    if state.capture is not None and state.capture.tinker:
        done = record.tinker_sample(state, future["request_id"], ref, job, started)
        state.futures.on_done(future["request_id"], done)
    # One id per sample, fixed now (tinker>=0.38 asserts them; older clients ignore them).
    future["sample_sequence_ids"] = [f"{future['request_id']}:{i}" for i in range(body.num_samples)]
    return future


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
    if body.record_stability_info:
        raise RequestError(
            "record_stability_info: stability records (for the stable_reinforce loss) are not "
            "kept on this server; train with importance_sampling or ppo instead"
        )
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not body.prompt_logprobs:
            raise RequestError("prompt_logprobs_last_n: needs prompt_logprobs=true")
        if last_n > len(prompt) - 1:
            raise RequestError(
                f"prompt_logprobs_last_n: {last_n} is more than the {len(prompt) - 1} prompt "
                "tokens that can be scored (the first has no context)"
            )
    target = sparse = None
    if body.target_prompt_logprobs is not None:
        target, sparse = _target_ids(body.target_prompt_logprobs, len(prompt), info["vocab_size"])
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
        prompt_logprobs_last_n=last_n,
        topk_sample_logprobs=body.topk_sample_logprobs,
        target_prompt=target,
        target_sparse=sparse,
        prompt_alt_k=body.prompt_alt_tokens_k,
    )


MAX_TARGET_CELLS = 1 << 22  # target_prompt_logprobs: cells per request (4M int64 = 32 MB)


def _target_ids(
    tensor: TensorData, n: int, vocab: int
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """``target_prompt_logprobs`` as a dense int64 [n - 1, K] array, -1 where nothing is asked,
    and its sparse layout (crow, col) if it came sparse; 400 naming what does not fit."""
    where = "target_prompt_logprobs"
    shape = tensor.shape
    if shape is None or len(shape) != 2 or shape[0] != n - 1:
        raise RequestError(f"{where}.shape: {shape} is not [len(prompt) - 1, K] = [{n - 1}, K]")
    if shape[0] * shape[1] > MAX_TARGET_CELLS:
        raise RequestError(f"{where}.shape: {shape} asks for more than {MAX_TARGET_CELLS} cells")
    if tensor.dtype not in ("int64", "int32"):
        raise RequestError(f"{where}.dtype: {tensor.dtype!r}; token ids are int64")
    values = np.asarray(tensor.data, dtype=np.int64)
    sparse = None
    if tensor.sparse_crow_indices is None:
        if values.size != shape[0] * shape[1]:
            raise RequestError(f"{where}.data: {values.size} values for the shape {shape}")
        dense = values.reshape(shape)
    else:
        crow = np.asarray(tensor.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(tensor.sparse_col_indices or [], dtype=np.int64)
        if (
            len(crow) != shape[0] + 1 or len(col) != len(values) or crow[0] != 0
            or crow[-1] != len(values) or np.any(np.diff(crow) < 0)
            or (col.size and (col.min() < 0 or col.max() >= shape[1]))
        ):  # fmt: skip
            raise RequestError(f"{where}: inconsistent sparse CSR indices for the shape {shape}")
        dense = np.full(shape, -1, dtype=np.int64)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        sparse = (crow, col)
    asked = dense[dense != -1]
    if asked.size and (asked.min() < 0 or asked.max() >= vocab):
        raise RequestError(f"{where}: a token id is outside 0..{vocab - 1} (-1 asks for nothing)")
    return dense, sparse
