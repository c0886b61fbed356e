"""Routes for weights and sampling: save/load state, sampler snapshots, sampling sessions,
``asample``. Files are written by the engine; this side names, checks and records them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import FastAPI, HTTPException

from rlcli.server import checkpoints, wire
from rlcli.server.checkpoints import CheckpointError, CheckpointRef
from rlcli.server.sampling import SampleJob
from rlcli.server.validate import RequestError, check_token_ids

if TYPE_CHECKING:
    from rlcli.server.app import ServerState

MAX_SAMPLES_PER_REQUEST = 128


@dataclass
class SamplerRef:
    """What a sampling session samples from: the engine's snapshot key (None: base model)."""

    key: str | None
    base_model: str
    model_path: str | None = None


def _checkpoint_error(e: CheckpointError) -> HTTPException:
    return HTTPException(400, str(e))


def resolve_checkpoint(state: ServerState, path: str) -> tuple[CheckpointRef, Any]:
    """A tinker:// path that exists on disk -> (ref, folder); 400 if malformed, 404 if absent."""
    try:
        ref = checkpoints.parse_tinker_path(path)
    except CheckpointError as e:
        raise _checkpoint_error(e) from None
    folder = ref.folder(state.checkpoints_root)
    if not (folder / "adapter_model.safetensors").exists():
        raise HTTPException(404, f"path: no checkpoint at {path}")
    return ref, folder


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/api/v1/save_weights")
    async def save_weights(body: dict):
        return _save(state, body, kind="weights")

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(body: dict):
        if body.get("path"):
            return _save(state, body, kind="sampler_weights")
        # Unnamed: an ephemeral snapshot, answered with a sampling session id.
        model_id = str(body.get("model_id"))
        record = state.model(model_id)
        session_id = f"sampler-{uuid.uuid4()}"
        key = f"ephemeral:{session_id}"
        state.sampling_sessions[session_id] = SamplerRef(key, record.base_model)
        request_id = state.engine.submit(
            "save_weights_for_sampler",
            "snapshot_sampler",
            model_id=model_id,
            key=key,
            directory=None,
            meta={"sampling_session_id": session_id},
        )
        return {"request_id": request_id, "model_id": model_id}

    @app.post("/api/v1/load_weights")
    async def load_weights(body: dict):
        model_id = str(body.get("model_id"))
        state.model(model_id)
        path = str(body.get("path", ""))
        _, folder = resolve_checkpoint(state, path)
        request_id = state.engine.submit(
            "load_weights",
            "load_state",
            model_id=model_id,
            directory=str(folder),
            optimizer=bool(body.get("optimizer", False)),
            path=path,
        )
        return {"request_id": request_id, "model_id": model_id}

    @app.post("/api/v1/weights_info")
    async def weights_info(body: dict):
        ref, _ = resolve_checkpoint(state, str(body.get("tinker_path", "")))
        run = checkpoints.read_run(state.checkpoints_root, ref.run_id) or {}
        lora = run.get("lora", {})
        return {
            "base_model": run.get("base_model", state.settings.base_model),
            "is_lora": True,
            "lora_rank": lora.get("rank"),
            "train_unembed": lora.get("train_unembed", True),
            "train_mlp": lora.get("train_mlp", True),
            "train_attn": lora.get("train_attn", True),
        }

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(body: dict):
        state.session(str(body.get("session_id")))
        ref = _sampler_ref(state, body.get("model_path"), body.get("base_model"))
        session_id = f"sampler-{uuid.uuid4()}"
        state.sampling_sessions[session_id] = ref
        return {"type": "create_sampling_session", "sampling_session_id": session_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        ref = state.sampling_sessions.get(sampler_id)
        if ref is None:
            raise HTTPException(404, f"sampler_id: unknown sampler {sampler_id!r}")
        return {
            "sampler_id": sampler_id,
            "base_model": ref.base_model,
            "model_path": ref.model_path,
        }

    @app.post("/api/v1/asample")
    async def asample(body: dict):
        info = state.engine_info()
        if body.get("sampling_session_id"):
            ref = state.sampling_sessions.get(str(body["sampling_session_id"]))
            if ref is None:
                raise HTTPException(
                    404, f"sampling_session_id: unknown session {body['sampling_session_id']!r}"
                )
        else:
            ref = _sampler_ref(state, body.get("model_path"), body.get("base_model"))
        try:
            job = _sample_job(body, info)
        except (RequestError, wire.WireError) as e:
            raise HTTPException(400, str(e)) from None
        job.sampler = ref.key
        request_id = state.engine.submit("sample", "sample", job=job)
        return {"request_id": request_id, "model_id": None}


def _save(state: ServerState, body: dict, kind: str) -> dict:
    model_id = str(body.get("model_id"))
    record = state.model(model_id)
    try:
        name = checkpoints.check_name(str(body.get("path") or ""))
    except CheckpointError as e:
        raise _checkpoint_error(e) from None
    ref = CheckpointRef(model_id, kind, name)
    folder = ref.folder(state.checkpoints_root)
    ttl = body.get("ttl_seconds")
    meta = {
        "checkpoint_id": ref.checkpoint_id,
        "checkpoint_type": "training" if kind == "weights" else "sampler",
        "tinker_path": ref.tinker_path,
        "training_run_id": model_id,
        "base_model": record.base_model,
        "expires_at": time.time() + ttl if ttl else None,
    }
    where = {"model_id": model_id, "directory": str(folder), "meta": meta}
    if kind == "weights":
        request_id = state.engine.submit("save_weights", "save_state", **where)
    else:  # also kept as a sampler snapshot, so sampling from it needs no reload
        request_id = state.engine.submit(
            "save_sampler_weights", "snapshot_sampler", key=str(folder), **where
        )
    return {"request_id": request_id, "model_id": model_id}


def _sampler_ref(state: ServerState, model_path: Any, base_model: Any) -> SamplerRef:
    if model_path:
        ref, folder = resolve_checkpoint(state, str(model_path))
        run = checkpoints.read_run(state.checkpoints_root, ref.run_id) or {}
        base = run.get("base_model", state.settings.base_model)
        return SamplerRef(str(folder), base, str(model_path))
    if not base_model or not state.accepts_base_model(str(base_model)):
        raise HTTPException(
            400,
            f"base_model: {base_model!r} is not served here; this server serves "
            f"{state.settings.base_model!r}",
        )
    return SamplerRef(None, state.settings.base_model)


def _sample_job(body: dict, info: dict) -> SampleJob:
    prompt = wire.prompt_tokens(body.get("prompt"))
    if prompt.size == 0:
        raise RequestError("prompt: empty; send at least one token")
    check_token_ids(prompt, info["vocab_size"], "prompt")
    params = body.get("sampling_params") or {}
    num_samples = body.get("num_samples", 1)
    if not isinstance(num_samples, int) or not 1 <= num_samples <= MAX_SAMPLES_PER_REQUEST:
        raise RequestError(f"num_samples: {num_samples!r} is outside 1..{MAX_SAMPLES_PER_REQUEST}")
    room = info["max_context"] - len(prompt)
    max_tokens = params.get("max_tokens")
    max_tokens = room if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise RequestError(f"sampling_params.max_tokens: {max_tokens!r} is not a count >= 0")
    if max_tokens > room:
        raise RequestError(
            f"sampling_params.max_tokens: {max_tokens} + a {len(prompt)}-token prompt exceeds "
            f"the model's context of {info['max_context']}"
        )
    temperature = float(params.get("temperature", 1.0))
    top_p = float(params.get("top_p", 1.0))
    top_k = int(params.get("top_k", -1))
    if temperature < 0 or not np.isfinite(temperature):
        raise RequestError(f"sampling_params.temperature: {temperature} must be >= 0")
    if not 0 < top_p <= 1:
        raise RequestError(f"sampling_params.top_p: {top_p} must be in (0, 1]")
    stop = params.get("stop")
    stop_tokens: list[int] = []
    stop_strings: list[str] = []
    if isinstance(stop, str):
        stop_strings = [stop]
    elif isinstance(stop, list):
        if all(isinstance(s, str) for s in stop):
            stop_strings = list(stop)
        elif all(isinstance(s, int) for s in stop):
            stop_tokens = list(stop)
            check_token_ids(np.asarray(stop_tokens), info["vocab_size"], "sampling_params.stop")
        else:
            raise RequestError("sampling_params.stop: a string, a list of strings or of token ids")
    topk_prompt = int(body.get("topk_prompt_logprobs") or 0)
    return SampleJob(
        prompt=prompt,
        num_samples=num_samples,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=params.get("seed"),
        stop_tokens=stop_tokens,
        stop_strings=[s for s in stop_strings if s],
        prompt_logprobs=bool(body.get("prompt_logprobs")),
        topk_prompt_logprobs=max(0, topk_prompt),
    )
