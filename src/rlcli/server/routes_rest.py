"""The REST surface of the official ``tinker`` CLI: training runs and checkpoints (list, info,
delete, archive download). Everything here reads the checkpoints folder, so it survives a
restart. Times are ISO 8601 with a timezone (the CLI compares them with aware datetimes)."""

from __future__ import annotations

import secrets
import shutil
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from rlcli.server import checkpoints
from rlcli.server.checkpoints import CheckpointError, CheckpointRef

if TYPE_CHECKING:
    from rlcli.server.app import ServerState

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
        "public": False,
        "expires_at": iso(meta.get("expires_at")),
    }


def _cursor(offset: int, limit: int, total: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


def register(app: FastAPI, state: ServerState) -> None:
    root = state.checkpoints_root
    archives: dict[str, tuple[Path, float]] = {}  # token -> (checkpoint folder, expiry)

    def run_json(run: dict[str, Any]) -> dict[str, Any]:
        run_id = run["training_run_id"]
        saved = checkpoints.list_checkpoints(root, run_id)
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

    def find_run(run_id: str) -> dict[str, Any]:
        try:
            run = checkpoints.read_run(root, run_id)
        except CheckpointError as e:
            raise HTTPException(400, str(e)) from None
        if run is None:
            raise HTTPException(404, f"training_run_id: unknown training run {run_id!r}")
        return run

    def find_checkpoint(run_id: str, kind: str, name: str) -> Path:
        if kind not in checkpoints.KINDS:
            raise HTTPException(404, f"checkpoint type {kind!r}: use weights or sampler_weights")
        try:
            ref = CheckpointRef(
                checkpoints.check_name(run_id, "run_id"), kind, checkpoints.check_name(name)
            )
        except CheckpointError as e:
            raise HTTPException(400, str(e)) from None
        folder = ref.folder(root)
        if not (folder / "checkpoint.json").exists():
            raise HTTPException(404, f"path: no checkpoint at {ref.tinker_path}")
        return folder

    @app.get("/api/v1/training_runs")
    async def list_training_runs(limit: int = 20, offset: int = 0):
        runs = checkpoints.list_runs(root)
        page = runs[offset : offset + limit]
        return {
            "training_runs": [run_json(r) for r in page],
            "cursor": _cursor(offset, limit, len(runs)),
        }

    @app.get("/api/v1/training_runs/{run_id}")
    async def get_training_run(run_id: str):
        return run_json(find_run(run_id))

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def list_run_checkpoints(run_id: str):
        find_run(run_id)
        saved = checkpoints.list_checkpoints(root, run_id)
        return {
            "checkpoints": [checkpoint_json(m) for m in saved],
            "cursor": _cursor(0, len(saved), len(saved)),
        }

    @app.get("/api/v1/checkpoints")
    async def list_all_checkpoints(limit: int = 100, offset: int = 0):
        saved = [
            meta
            for run in checkpoints.list_runs(root)
            for meta in checkpoints.list_checkpoints(root, run["training_run_id"])
        ]
        page = saved[offset : offset + limit]
        return {
            "checkpoints": [checkpoint_json(m) for m in page],
            "cursor": _cursor(offset, limit, len(saved)),
        }

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}", status_code=204)
    async def delete_checkpoint(run_id: str, kind: str, name: str):
        shutil.rmtree(find_checkpoint(run_id, kind, name))

    @app.get("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/archive")
    async def checkpoint_archive(run_id: str, kind: str, name: str, request: Request):
        folder = find_checkpoint(run_id, kind, name)
        now = time.time()
        for token in [t for t, (_, exp) in archives.items() if exp < now]:
            del archives[token]
        token = secrets.token_urlsafe(24)
        archives[token] = (folder, now + ARCHIVE_TTL_S)
        # The CLI downloads this URL with plain urllib and no API key: the token is the key.
        url = str(request.base_url).rstrip("/") + f"/rlcli/archives/{token}.tar"
        return {"url": url, "expires": iso(now + ARCHIVE_TTL_S)}

    @app.get("/rlcli/archives/{token}.tar")
    async def download_archive(token: str):
        entry = archives.get(token)
        if entry is None or entry[1] < time.time():
            raise HTTPException(404, "archive link unknown or expired; ask for a new one")
        folder = entry[0]
        if not folder.exists():
            raise HTTPException(404, "the checkpoint was deleted")
        fd, tar_path = tempfile.mkstemp(suffix=".tar")
        with open(fd, "wb") as out, tarfile.open(fileobj=out, mode="w") as tar:
            for name in ARCHIVE_FILES:
                tar.add(folder / name, arcname=name)
            tar.addfile(tarfile.TarInfo("checkpoint_complete"))  # `tinker ... push-hf` wants it
        return FileResponse(
            tar_path,
            media_type="application/x-tar",
            filename=f"{folder.parent.parent.name}_{folder.parent.name}_{folder.name}.tar",
            background=BackgroundTask(Path(tar_path).unlink, missing_ok=True),
        )
