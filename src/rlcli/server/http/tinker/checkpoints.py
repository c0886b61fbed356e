"""Checkpoint routes of training clients: save state, save sampler weights (named, or an
unnamed snapshot answered with a sampling session), load state, weights info. The engine
writes the files (``store/checkpoints.py``); this side names, checks and records them."""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

from fastapi import APIRouter, HTTPException

from rlcli.checkpoint_format import expires_at
from rlcli.server.engine import ops
from rlcli.server.http.tinker import generations
from rlcli.server.http.tinker.schemas import (
    LoadWeights,
    LoraConfig,
    SaveWeights,
    SaveWeightsExternal,
    WeightsInfo,
)
from rlcli.server.http.tinker.training import check_optimizer, new_training_client
from rlcli.server.state.sessions import SamplerRef, ServerState, State
from rlcli.server.store import checkpoints
from rlcli.server.store.checkpoints import CheckpointRef

router = APIRouter(prefix="/api/v1")


def resolve_checkpoint(state: ServerState, path: str) -> tuple[CheckpointRef, Path]:
    """A tinker:// path that names a live checkpoint -> (ref, its name on disk);
    400 if malformed, 404 if absent or expired."""
    ref = checkpoints.parse_tinker_path(path)
    folder = ref.folder(state.checkpoints_root)
    if checkpoints.resolve(folder) is None:
        raise HTTPException(404, f"path: no checkpoint at {path}")
    return ref, folder


@router.post("/save_weights")
async def save_weights(body: SaveWeights, state: State):
    return _save(state, body, kind="weights")


@router.post("/save_weights_external")
async def save_weights_external(body: SaveWeightsExternal, state: State):
    """tinker>=0.38: the adapter as plain files under ``tinker://<run>/external_weights/<name>``,
    fetched through ``external_weights_urls`` (``tinker checkpoint download``)."""
    record = state.model(body.model_id)
    refusal = generations.needs_current("save_weights_external", _session_version(state, record))
    if refusal:
        raise HTTPException(400, refusal)
    if body.age_encryption_recipients:
        raise HTTPException(
            400,
            "age_encryption_recipients: encrypted exports are not implemented on this server "
            "(it serves the files to this machine only); export without recipients",
        )
    folder, meta = _checkpoint(state, record, "external_weights", body.path, body.ttl_seconds)
    op = ops.SaveExternal(body.model_id, folder, meta)
    return state.submit_for(record, op, body.seq_id, body.model_dump_json().encode())


def _session_version(state: ServerState, record) -> str | None:
    session = state.sessions.get(record.session_id)
    return session.sdk_version if session else None


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: SaveWeights, state: State):
    if body.path:
        return _save(state, body, kind="sampler_weights")
    # Unnamed: an ephemeral snapshot, answered with a sampling session id.
    record = state.model(body.model_id)
    sampler_id = f"sampler-{uuid.uuid4()}"
    key = f"ephemeral:{sampler_id}"
    retry = bool(body.seq_id) and body.seq_id in record.seen  # its session exists already
    op = ops.SnapshotSampler(body.model_id, key, None)
    future = state.submit_for(record, op, body.seq_id, body.model_dump_json().encode())
    if retry:
        return future
    state.add_sampling_session(sampler_id, SamplerRef(key, record.base_model, record.session_id))
    return future


@router.post("/load_weights")
async def load_weights(body: LoadWeights, state: State):
    if body.session_id is not None or body.model_id is None:
        return _create_via_load(body, state)
    record = state.model(body.model_id)
    retry = bool(body.seq_id) and body.seq_id in record.seen  # answered by submit_for
    if record.requests and not retry:
        raise HTTPException(
            400,
            f"load_weights is not permitted with seq_id {body.seq_id}: loading a state must be "
            "a training client's first request (as on Tinker); create a new training client "
            "from the state instead (ServiceClient.create_training_client_from_state)",
        )
    _, folder = resolve_checkpoint(state, body.path)
    op = ops.LoadState(body.model_id, str(folder), body.optimizer, body.path)
    return state.submit_for(record, op, body.seq_id, body.model_dump_json().encode())


def _create_via_load(body: LoadWeights, state: ServerState) -> dict:
    """tinker>=0.38: a new training client made from a checkpoint in one request. Its id is
    the one the client derives, ``<session_id>:train:<model_seq_id>``; its LoRA config and
    role (policy or critic) are the checkpoint's run's. A resent request (same body) gets the
    first one's future."""
    if body.session_id is None or body.model_seq_id is None:
        raise HTTPException(
            400, "load_weights: send model_id and seq_id (load into a training client), or "
            "session_id and model_seq_id (create one from the checkpoint)",
        )  # fmt: skip
    session = state.session(body.session_id)
    refusal = generations.needs_current("session_id", session.sdk_version)
    if refusal:
        raise HTTPException(400, f"{refusal} (create via load_weights)")
    state.engine_info()
    check_optimizer(body.optimizer_config)
    if body.base_model is not None:
        state.check_base_model(body.base_model)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    payload = body.model_dump_json().encode()
    if model_id in state.models or model_id in state.finished_models:
        seen = state.model(model_id).seen.get(0)
        if seen is not None and seen[0] == hashlib.sha256(payload).hexdigest():
            return seen[1]
        raise HTTPException(409, f"model_seq_id: {body.model_seq_id} is taken in this session")
    ref, folder = resolve_checkpoint(state, body.path)
    run = checkpoints.read_run(state.checkpoints_root, ref.run_id) or {}
    try:
        lora = LoraConfig.model_validate(run.get("lora") or {})
    except ValueError:
        raise HTTPException(409, f"path: {body.path} has no readable LoRA config") from None
    op = ops.LoadState(model_id, str(folder), body.optimizer, body.path)
    critic = run.get("model_role") == "critic"  # a critic's checkpoint makes a critic
    future = new_training_client(
        state, model_id, body.session_id, lora, body.user_metadata, then=op, payload=payload,
        critic=critic,
    )  # fmt: skip
    state.models[model_id].seen[0] = (hashlib.sha256(payload).hexdigest(), future)
    return future


@router.post("/weights_info")
async def weights_info(body: WeightsInfo, state: State):
    ref, _ = resolve_checkpoint(state, body.tinker_path)
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


def _checkpoint(
    state: ServerState, record, kind: str, name: str, ttl_seconds: int | None
) -> tuple[str, dict]:
    """A checkpoint of ``record`` about to be written: its name on disk and its metadata."""
    ref = CheckpointRef(record.model_id, kind, checkpoints.check_name(name or ""))
    return str(ref.folder(state.checkpoints_root)), {
        "checkpoint_id": ref.checkpoint_id,
        "checkpoint_type": checkpoints.TYPES[kind],
        "tinker_path": ref.tinker_path,
        "training_run_id": record.model_id,
        "base_model": record.base_model,
        # --checkpoint-ttl: what the client asked, never, or the server's own time
        "expires_at": expires_at(state.settings.checkpoint_ttl_rule, ttl_seconds, time.time()),
        "public": False,
    }


def _save(state: ServerState, body: SaveWeights, kind: str) -> dict:
    record = state.model(body.model_id)
    folder, meta = _checkpoint(state, record, kind, body.path or "", body.ttl_seconds)
    if kind == "weights":
        op = ops.SaveState(body.model_id, folder, meta)
    else:  # also kept as sampler weights, so sampling from it needs no reload
        op = ops.SnapshotSampler(body.model_id, folder, folder, meta)
    return state.submit_for(record, op, body.seq_id, body.model_dump_json().encode())
