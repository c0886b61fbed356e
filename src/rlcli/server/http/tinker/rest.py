"""The REST surface of the official ``tinker`` CLI: training runs and checkpoints (list, info,
delete, publish, TTL, archive download). Everything here reads the checkpoints folder, so it
survives a restart. Times are ISO 8601 with a timezone (the CLI compares aware datetimes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse

from rlcli.checkpoint_format import ADAPTER_FILES, RESTORE_FILES
from rlcli.server.engine import ops
from rlcli.server.http.tinker import generations
from rlcli.server.http.tinker.schemas import SetTtl
from rlcli.server.state.engine_client import EngineUnavailable
from rlcli.server.state.sessions import ServerState, State
from rlcli.server.store import checkpoints
from rlcli.server.store.checkpoints import CheckpointRef

router = APIRouter(prefix="/api/v1")
public = APIRouter()  # the archive link: the CLI fetches it with plain urllib and no key

ARCHIVE_TTL_S = 15 * 60
WITH_OPTIMIZER = "o-"  # archive tokens that include optimizer.pt and run.json start so;
PLAIN = "a-"  # the others start so (a bare random token could begin with "o-");
EXTERNAL = "x-"  # tokens of an external weights checkpoint's files (tinker>=0.38) start so


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


def _visible(request: Request, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A legacy client's strict models reject the ``external`` checkpoint type: hide those."""
    if not generations.is_legacy(generations.header_version(request.headers)):
        return saved
    return [meta for meta in saved if meta.get("checkpoint_type") != "external"]


def _run_json(state: ServerState, run: dict[str, Any]) -> dict[str, Any]:
    run_id = run["training_run_id"]
    saved = checkpoints.list_checkpoints(state.checkpoints_root, run_id)
    last = {kind: None for kind in ("training", "sampler")}
    for meta in saved:  # oldest first: the last one of each type wins
        if meta["checkpoint_type"] in last:
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
            400,
            f"checkpoint_id: {kind}/{name!r} is not weights/<name>, sampler_weights/<name> or "
            "external_weights/<name>",
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
async def list_run_checkpoints(run_id: str, request: Request, state: State):
    _find_run(state, run_id)
    saved = _visible(request, checkpoints.list_checkpoints(state.checkpoints_root, run_id))
    return {
        "checkpoints": [checkpoint_json(m) for m in saved],
        "cursor": _cursor(0, len(saved), len(saved)),
    }


@router.get("/checkpoints")
async def list_all_checkpoints(request: Request, state: State, limit: int = 100, offset: int = 0):
    root = state.checkpoints_root
    saved = _visible(request, [
        meta
        for run in checkpoints.list_runs(root)[::-1]  # newest runs first
        for meta in checkpoints.list_checkpoints(root, run["training_run_id"])
    ])  # fmt: skip
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
    _edit(state, run_id, kind, name, public=True)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", status_code=204)
async def unpublish_checkpoint(run_id: str, kind: str, name: str, state: State):
    _edit(state, run_id, kind, name, public=False)


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", status_code=204)
async def set_checkpoint_ttl(run_id: str, kind: str, name: str, body: SetTtl, state: State):
    expires = time.time() + body.ttl_seconds if body.ttl_seconds else None
    _edit(state, run_id, kind, name, expires_at=expires)


def _edit(state: ServerState, run_id: str, kind: str, name: str, **changes: Any) -> None:
    """Publish / TTL: applied to the version the name points to when the edit commits."""
    folder, _ = _find_checkpoint(state, run_id, kind, name)
    if checkpoints.edit_meta(folder, **changes) is None:
        raise HTTPException(404, f"path: the checkpoint {kind}/{name} was deleted meanwhile")


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(run_id: str, kind: str, name: str, request: Request, state: State):
    """tinker>=0.38: one link per file of an external weights checkpoint (a PEFT adapter),
    served by this server without a key (the CLI fetches them with plain urllib)."""
    if kind != "external_weights":
        raise HTTPException(
            400, f"checkpoint_id: {kind}/{name}: only external_weights/<name> has file links "
            "(save_weights_external makes one)",
        )  # fmt: skip
    folder, _ = _find_checkpoint(state, run_id, kind, name)
    now = time.time()
    token = _issue_token(state, EXTERNAL, folder, now)
    base = str(request.base_url).rstrip("/")
    urls = {f: f"{base}/rlcli/external/{token}/{f}" for f in ADAPTER_FILES}
    return {"urls": urls, "expires": iso(now + ARCHIVE_TTL_S)}


def _issue_token(state: ServerState, prefix: str, folder: Path, now: float) -> str:
    for token in [t for t, (_, exp) in state.archives.items() if exp < now]:
        del state.archives[token]
    # The choice is remembered with the token: only tokens the server issued are in the table.
    token = prefix + secrets.token_urlsafe(24)
    state.archives[token] = (folder, now + ARCHIVE_TTL_S)
    return token


@public.get("/rlcli/external/{token}/{filename}")
async def download_external_file(token: str, filename: str, state: State):
    entry = state.archives.get(token)
    if not token.startswith(EXTERNAL) or entry is None or entry[1] < time.time():
        raise HTTPException(404, "file link unknown or expired; ask for new links")
    if filename not in ADAPTER_FILES:
        raise HTTPException(404, f"filename: {filename!r} is not a file of this checkpoint")
    version = checkpoints.resolve(entry[0])
    if version is None:
        raise HTTPException(404, "the checkpoint was deleted")
    return FileResponse(version / filename, filename=filename)


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/archive")
async def checkpoint_archive(
    run_id: str,
    kind: str,
    name: str,
    request: Request,
    state: State,
    include_optimizer: bool = False,
):
    """A link to a tar of the checkpoint. ``include_optimizer`` (rlcli's opt-in; the tinker
    CLI never sends it) adds ``optimizer.pt`` and the run's ``run.json`` of a training state,
    so ``rlcli restore`` can continue the run on another server."""
    folder, version = _find_checkpoint(state, run_id, kind, name)
    if include_optimizer:
        if kind != "weights":
            raise HTTPException(
                400, "include_optimizer: only a training state (weights/<name>) has one"
            )
        for needed in (version / "optimizer.pt", folder.parent.parent / "run.json"):
            if not needed.is_file():
                raise HTTPException(409, f"include_optimizer: {run_id} has no {needed.name}")
    now = time.time()
    token = _issue_token(state, WITH_OPTIMIZER if include_optimizer else PLAIN, folder, now)
    url = str(request.base_url).rstrip("/") + f"/rlcli/archives/{token}.tar"
    return {"url": url, "expires": iso(now + ARCHIVE_TTL_S)}


@public.get("/rlcli/archives/{token}.tar")
async def download_archive(token: str, state: State):
    entry = state.archives.get(token)
    if token.startswith(EXTERNAL) or entry is None or entry[1] < time.time():
        raise HTTPException(404, "archive link unknown or expired; ask for a new one")
    folder = entry[0]
    version = checkpoints.resolve(folder)  # the version current now, read whole
    if version is None:
        raise HTTPException(404, "the checkpoint was deleted")
    extra = {}
    if token.startswith(WITH_OPTIMIZER):
        extra = {
            "optimizer.pt": version / "optimizer.pt",
            "run.json": folder.parent.parent / "run.json",
        }
    key, tar_path = await state.tars.acquire(version, extra)  # shared by concurrent downloads
    name = f"{folder.parent.parent.name}_{folder.parent.name}_{folder.name}.tar"
    return state.tars.response(key, tar_path, name)


# ---- rlcli restore: a training state exported elsewhere, put back under its tinker:// path ----

RESTORE_IGNORED = ("checkpoint.json", "checkpoint_complete")  # the old server's, remade here
# Uploads: their bodies are capped by --max-upload-gb (app.BodyLimit), all others by
# --max-body-mb. A LoRA state (adapter + AdamW moments) of a 70B model at rank 64 is a few GB.
UPLOADS = "/api/v1/rlcli/restore/"


@router.put("/rlcli/restore/{run_id}/{kind}/{name}")
async def restore_checkpoint(
    run_id: str,
    kind: str,
    name: str,
    request: Request,
    state: State,
    overwrite: bool = False,
    force: bool = False,
):
    """Install a tar made by ``rlcli export --with-optimizer`` (adapter, optimizer.pt and the
    run's run.json) as ``tinker://<run_id>/weights/<name>`` on this server, so a run moved from
    another server continues here (``create_training_client_from_state_with_optimizer``, or a
    resumed ``rlcli train``). Names, sizes and headers are checked first; the checkpoint is
    written as a new version (invariant 3), so a failure leaves nothing half-written.
    ``force`` accepts a state whose base model has another name than this server's."""
    if kind != "weights":
        raise HTTPException(400, f"kind: {kind!r}: only a training state (weights/<name>)")
    ref = CheckpointRef(
        checkpoints.check_name(run_id, "run_id"), kind, checkpoints.check_name(name)
    )
    folder = ref.folder(state.checkpoints_root)
    if checkpoints.resolve(folder) is not None and not overwrite:
        raise HTTPException(
            409, f"path: {ref.tinker_path} exists here (overwrite=true replaces it)"
        )
    # Staged on the checkpoints' own disk (the system temp dir is often RAM), then renamed in.
    staging = checkpoints.staging_dir(state.checkpoints_root)
    with tempfile.TemporaryDirectory(prefix="restore-", dir=staging) as tmp:
        upload = Path(tmp) / "upload.tar"
        with open(upload, "wb") as out:
            async for chunk in request.stream():  # at most --max-upload-gb (app.BodyLimit)
                out.write(chunk)
        cap = state.settings.max_upload_bytes
        files = await asyncio.to_thread(_unpack_state, upload, Path(tmp) / "files", cap)
        run = json.loads(files["run.json"].read_text())
        base_model = state.settings.base_model
        if run.get("base_model") != base_model and not force:
            raise HTTPException(
                400,
                f"base_model: the state was trained on {run.get('base_model')!r}; this server "
                f"hosts {base_model!r} (force=true if they are the same model)",
            )
        adapter = json.loads(files["adapter_config.json"].read_text())
        here = checkpoints.read_run(state.checkpoints_root, run_id)
        if here is not None and here.get("lora", {}).get("rank") != adapter["r"]:
            raise HTTPException(
                409, f"run_id: run {run_id} exists here with another LoRA rank than the state's"
            )
        adapter["base_model_name_or_path"] = base_model
        files["adapter_config.json"].write_text(json.dumps(adapter, indent=2) + "\n")
        meta = {
            "checkpoint_id": ref.checkpoint_id,
            "checkpoint_type": "training",
            "tinker_path": ref.tinker_path,
            "training_run_id": run_id,
            "base_model": base_model,
            "expires_at": None,
            "public": False,
            "restored": time.time(),
        }
        if here is None:  # the run first: weights_info reads its LoRA settings from run.json
            record = {
                "training_run_id": run_id,
                "base_model": base_model,
                "lora": run["lora"],
                "session_id": None,
                "user_metadata": run.get("user_metadata") or {},
                "created": time.time(),
                "restored_from": run.get("base_model"),
            }
            checkpoints.write_run(state.checkpoints_root, run_id, record)
        sources = {n: files[n] for n in RESTORE_FILES if n != "run.json"}
        # Checked again as the name is set: another restore or a save may have taken it
        # during the upload (409, nothing written).
        try:
            version = await asyncio.to_thread(
                checkpoints.write_files, folder, sources, meta, not overwrite
            )
        except BaseException:
            root = state.checkpoints_root
            if here is None and not checkpoints.list_checkpoints(root, run_id):
                (root / run_id / "run.json").unlink(missing_ok=True)  # no orphan run left
            raise
    return {"tinker_path": ref.tinker_path, "size_bytes": checkpoints.folder_size(version)}


def _unpack_state(tar_path: Path, out: Path, cap: int) -> dict[str, Path]:
    """The tar's files, checked: plain regular files with the expected names, each once, whole
    (sizes as declared), JSON that parses, a safetensors header that fits the file; else 400.

    Only plain members: a sparse one (GNU or PAX) is written out with its holes filled, so a
    few KB of upload could become gigabytes. The bytes actually written are counted against
    ``cap`` as they are written, whatever the headers claim."""
    out.mkdir()
    files: dict[str, Path] = {}
    written = 0
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            for member in tar:
                if member.name in RESTORE_IGNORED:
                    continue
                if member.name not in RESTORE_FILES or not member.isfile():
                    raise HTTPException(
                        400, f"body: unexpected archive member {member.name!r} (a state has "
                        f"{', '.join(RESTORE_FILES)})"
                    )  # fmt: skip
                if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.sparse:
                    raise HTTPException(
                        400, f"body: {member.name!r} is not a plain file (sparse or special)"
                    )
                if member.name in files:
                    raise HTTPException(400, f"body: {member.name!r} appears twice")
                source = tar.extractfile(member)
                target = out / member.name
                with source, open(target, "wb") as f:
                    while chunk := source.read(1 << 20):
                        written += len(chunk)
                        if written > cap:
                            raise HTTPException(413, f"body: unpacks to more than {cap} bytes")
                        f.write(chunk)
                if target.stat().st_size != member.size:
                    raise HTTPException(400, f"body: {member.name!r} is cut short")
                files[member.name] = target
    except (tarfile.TarError, EOFError, OSError) as e:
        raise HTTPException(400, f"body: not a whole tar archive ({e})") from None
    missing = [n for n in RESTORE_FILES if n not in files]
    if missing:
        raise HTTPException(400, f"body: the archive lacks {', '.join(missing)}")
    try:
        adapter = json.loads(files["adapter_config.json"].read_text())
        run = json.loads(files["run.json"].read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPException(400, f"body: a JSON file does not parse ({e})") from None
    if not isinstance(adapter, dict) or not isinstance(adapter.get("r"), int):
        raise HTTPException(400, "body: adapter_config.json has no LoRA rank 'r'")
    lora = run.get("lora") if isinstance(run, dict) else None
    if not isinstance(lora, dict) or lora.get("rank") != adapter["r"]:
        raise HTTPException(400, "body: run.json's LoRA rank differs from adapter_config.json's")
    _check_safetensors(files["adapter_model.safetensors"])
    if files["optimizer.pt"].stat().st_size == 0:
        raise HTTPException(400, "body: optimizer.pt is empty")
    return files


def _check_safetensors(path: Path) -> None:
    """The header parses and every tensor's bytes lie inside the file (no torch here)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise HTTPException(400, "body: adapter_model.safetensors has no valid header")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise HTTPException(400, "body: adapter_model.safetensors' header does not parse")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        end = (entry.get("data_offsets") or [0, size])[1] if isinstance(entry, dict) else size
        if not isinstance(end, int) or 8 + length + end > size:
            raise HTTPException(
                400, f"body: adapter_model.safetensors: tensor {key!r} is cut short"
            )
