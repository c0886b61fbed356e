"""The REST surface of the official ``tinker`` CLI: training runs and checkpoints (list, info,
delete, publish, TTL, archive download). Everything here reads the checkpoints folder, so it
survives a restart. Times are ISO 8601 with a timezone (the CLI compares aware datetimes)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from rlcli.server import checkpoints, ops
from rlcli.server.checkpoints import CheckpointRef
from rlcli.server.engine_process import EngineUnavailable
from rlcli.server.schemas import SetTtl
from rlcli.server.state import ServerState, State

router = APIRouter(prefix="/api/v1")
public = APIRouter()  # the archive link: the CLI fetches it with plain urllib and no key

ARCHIVE_TTL_S = 15 * 60
ARCHIVE_FILES = ("adapter_config.json", "adapter_model.safetensors", "checkpoint.json")


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def checkpoint_json(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "checkpoint_id": meta["checkpoint_id"],
        "checkpoint_type": meta["checkpoint_type"],
        "time": iso(meta.get("created")),
        "tinker_path": meta["tinker_path"],
        "size_bytes": meta.get("size_bytes"),
        "public": bool(meta.get("public")),
        "expires_at": iso(meta.get("expires_at")),
    }


def _cursor(offset: int, limit: int, total: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


def _run_json(state: ServerState, run: dict[str, Any]) -> dict[str, Any]:
    run_id = run["training_run_id"]
    saved = checkpoints.list_checkpoints(state.checkpoints_root, run_id)
    last = {kind: None for kind in ("training", "sampler")}
    for meta in saved:  # oldest first: the last one of each type wins
        last[meta["checkpoint_type"]] = checkpoint_json(meta)
    live = state.models.get(run_id)
    last_request = max(
        [run.get("created", 0)] + [m.get("created", 0) for m in saved]
        + ([live.last_request] if live else [])
    )  # fmt: skip
    return {
        "training_run_id": run_id,
        "base_model": run["base_model"],
        "model_owner": "local",
        "is_lora": True,
        "corrupted": False,
        "lora_rank": run.get("lora", {}).get("rank"),
        "last_request_time": iso(last_request),
        "last_checkpoint": last["training"],
        "last_sampler_checkpoint": last["sampler"],
        "user_metadata": {str(k): str(v) for k, v in (run.get("user_metadata") or {}).items()},
    }


def _find_run(state: ServerState, run_id: str) -> dict[str, Any]:
    run = checkpoints.read_run(state.checkpoints_root, run_id)
    if run is None:
        raise HTTPException(404, f"training_run_id: unknown training run {run_id!r}")
    return run


def _find_checkpoint(state: ServerState, run_id: str, kind: str, name: str) -> tuple[Path, Path]:
    """(the checkpoint's name on disk, the version folder it points to now); 400 / 404."""
    if kind not in checkpoints.KINDS:
        raise HTTPException(
            400, f"checkpoint_id: {kind}/{name!r} is not weights/<name> or sampler_weights/<name>"
        )
    ref = CheckpointRef(
        checkpoints.check_name(run_id, "run_id"), kind, checkpoints.check_name(name)
    )
    folder = ref.folder(state.checkpoints_root)
    version = checkpoints.resolve(folder)
    if version is None:
        raise HTTPException(404, f"path: no checkpoint at {ref.tinker_path}")
    return folder, version


@router.get("/training_runs")
async def list_training_runs(state: State, limit: int = 20, offset: int = 0):
    runs = checkpoints.list_runs(state.checkpoints_root)[::-1]  # newest first
    page = runs[max(0, offset) : max(0, offset) + max(0, limit)]
    return {
        "training_runs": [_run_json(state, r) for r in page],
        "cursor": _cursor(offset, limit, len(runs)),
    }


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, state: State):
    return _run_json(state, _find_run(state, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(run_id: str, state: State):
    _find_run(state, run_id)
    saved = checkpoints.list_checkpoints(state.checkpoints_root, run_id)
    return {
        "checkpoints": [checkpoint_json(m) for m in saved],
        "cursor": _cursor(0, len(saved), len(saved)),
    }


@router.get("/checkpoints")
async def list_all_checkpoints(state: State, limit: int = 100, offset: int = 0):
    root = state.checkpoints_root
    saved = [
        meta
        for run in checkpoints.list_runs(root)[::-1]  # newest runs first
        for meta in checkpoints.list_checkpoints(root, run["training_run_id"])
    ]
    page = saved[max(0, offset) : max(0, offset) + max(0, limit)]
    return {
        "checkpoints": [checkpoint_json(m) for m in page],
        "cursor": _cursor(offset, limit, len(saved)),
    }


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id}")
@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id}/archive")
@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish")
@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish")
@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl")
async def bare_checkpoint_id(run_id: str, checkpoint_id: str):
    """A checkpoint id without its kind (``0001`` for ``weights/0001``): say the form."""
    raise HTTPException(
        400,
        f"checkpoint_id: {checkpoint_id!r} needs its kind: weights/<name> or "
        "sampler_weights/<name>",
    )


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", status_code=204)
async def delete_checkpoint(run_id: str, kind: str, name: str, state: State):
    folder, _ = _find_checkpoint(state, run_id, kind, name)
    await asyncio.to_thread(checkpoints.delete, folder)
    if kind == "sampler_weights":
        # Drop the engine's cached copy too (it would notice on its own, at the next sample).
        with contextlib.suppress(EngineUnavailable):
            state.engine.submit(ops.ForgetSampler(str(folder)))


@router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", status_code=204)
async def publish_checkpoint(run_id: str, kind: str, name: str, state: State):
    # Idempotent: publishing a public checkpoint is a success, not a 409 (which tinker 0.25
    # retries for minutes).
    _, version = _find_checkpoint(state, run_id, kind, name)
    checkpoints.update_meta(version, public=True)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", status_code=204)
async def unpublish_checkpoint(run_id: str, kind: str, name: str, state: State):
    _, version = _find_checkpoint(state, run_id, kind, name)
    checkpoints.update_meta(version, public=False)


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", status_code=204)
async def set_checkpoint_ttl(run_id: str, kind: str, name: str, body: SetTtl, state: State):
    _, version = _find_checkpoint(state, run_id, kind, name)
    expires = time.time() + body.ttl_seconds if body.ttl_seconds else None
    checkpoints.update_meta(version, expires_at=expires)


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/archive")
async def checkpoint_archive(run_id: str, kind: str, name: str, request: Request, state: State):
    folder, _ = _find_checkpoint(state, run_id, kind, name)
    now = time.time()
    for token in [t for t, (_, exp) in state.archives.items() if exp < now]:
        del state.archives[token]
    token = secrets.token_urlsafe(24)
    state.archives[token] = (folder, now + ARCHIVE_TTL_S)
    url = str(request.base_url).rstrip("/") + f"/rlcli/archives/{token}.tar"
    return {"url": url, "expires": iso(now + ARCHIVE_TTL_S)}


@public.get("/rlcli/archives/{token}.tar")
async def download_archive(token: str, state: State):
    entry = state.archives.get(token)
    if entry is None or entry[1] < time.time():
        raise HTTPException(404, "archive link unknown or expired; ask for a new one")
    folder = entry[0]
    version = checkpoints.resolve(folder)  # the version current now, read whole
    if version is None:
        raise HTTPException(404, "the checkpoint was deleted")
    tar_path = await asyncio.to_thread(_build_tar, version)
    return FileResponse(
        tar_path,
        media_type="application/x-tar",
        filename=f"{folder.parent.parent.name}_{folder.parent.name}_{folder.name}.tar",
        background=BackgroundTask(Path(tar_path).unlink, missing_ok=True),
    )


def _build_tar(version: Path) -> str:
    fd, tar_path = tempfile.mkstemp(suffix=".tar")
    with open(fd, "wb") as out, tarfile.open(fileobj=out, mode="w") as tar:
        for name in ARCHIVE_FILES:
            tar.add(version / name, arcname=name)
        tar.addfile(tarfile.TarInfo("checkpoint_complete"))  # `tinker ... push-hf` wants it
    return tar_path
