"""Checkpoint routes of training clients: save state, save sampler weights (named, or an
unnamed snapshot answered with a sampling session), load state, weights info. The engine
writes the files (``checkpoints.py``); this side names, checks and records them."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from fastapi import APIRouter, HTTPException

from rlcli.server import checkpoints, ops
from rlcli.server.checkpoints import CheckpointRef
from rlcli.server.schemas import LoadWeights, SaveWeights, WeightsInfo
from rlcli.server.state import SamplerRef, ServerState, State

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


def _save(state: ServerState, body: SaveWeights, kind: str) -> dict:
    record = state.model(body.model_id)
    name = checkpoints.check_name(body.path or "")
    ref = CheckpointRef(body.model_id, kind, name)
    folder = str(ref.folder(state.checkpoints_root))
    meta = {
        "checkpoint_id": ref.checkpoint_id,
        "checkpoint_type": "training" if kind == "weights" else "sampler",
        "tinker_path": ref.tinker_path,
        "training_run_id": body.model_id,
        "base_model": record.base_model,
        "expires_at": time.time() + body.ttl_seconds if body.ttl_seconds else None,
        "public": False,
    }
    if kind == "weights":
        op = ops.SaveState(body.model_id, folder, meta)
    else:  # also kept as sampler weights, so sampling from it needs no reload
        op = ops.SnapshotSampler(body.model_id, folder, folder, meta)
    return state.submit_for(record, op, body.seq_id, body.model_dump_json().encode())
