"""Alias routes (``/rlcli/aliases``), behind the API key: list, show with history, set,
rollback. The table and its rules live in ``state/aliases.py``; this module checks what a
version may point at: a sampler checkpoint this server holds, of the base model it serves
(anything else is one 4xx line), or the base model itself. Setting an alias clears the TTL of
the checkpoints it names, so a served checkpoint never expires under its alias.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter
from pydantic import Field

from rlcli.server.http.tinker.schemas import Body
from rlcli.server.state.aliases import AliasError, MissingCheckpoint, check_alias_name
from rlcli.server.state.sessions import ServerState, State
from rlcli.server.store import checkpoints

log = logging.getLogger("rlcli.server")

router = APIRouter(prefix="/rlcli/aliases")


class SetAlias(Body):
    checkpoint: str = Field(min_length=1, max_length=1024)
    state: str | None = Field(None, max_length=1024)  # default: weights/<same name>, if saved
    by: str = Field("", max_length=256)
    why: str = Field("", max_length=2048)


class Rollback(Body):
    to: int | None = Field(None, ge=1, le=2**31)
    by: str = Field("", max_length=256)
    why: str = Field("", max_length=2048)


@router.get("")
async def list_aliases(state: State):
    return {"aliases": state.aliases.listing()}


@router.get("/{name:path}")
async def show_alias(name: str, state: State):
    return state.aliases.history(name)


@router.put("/{name:path}")
async def set_alias(name: str, body: SetAlias, state: State):
    check_alias_name(name)
    if state.accepts_base_model(name):
        raise AliasError(f"alias: {name!r} is the base model's name; choose another")
    version = _version(state, name, body.checkpoint, body.state)
    described = state.aliases.set(name, version, body.by, body.why)
    log.info("alias %s -> %s (version %d) by %s: %s", name, body.checkpoint,
             described["current"], body.by or "unknown", body.why)  # fmt: skip
    return described


@router.post("/{name:path}/rollback")
async def rollback_alias(name: str, body: Rollback, state: State):
    described = state.aliases.rollback(name, body.to, body.by, body.why)
    log.info("alias %s rolled back to version %d (%s) by %s: %s", name, described["current"],
             described["checkpoint"], body.by or "unknown", body.why)  # fmt: skip
    return described


def _version(state: ServerState, name: str, checkpoint: str, training_state: str | None) -> dict:
    """What an alias version records; refuses a checkpoint that cannot serve here."""
    base = state.settings.base_model
    if not checkpoint.startswith("tinker://"):
        if not state.accepts_base_model(checkpoint):
            raise AliasError(
                f"alias {name}: {checkpoint!r} is neither a tinker:// checkpoint nor the base "
                f"model this server serves ({base!r})"
            )
        if training_state:
            raise AliasError(f"alias {name}: state: the base model has no training state")
        return {"checkpoint": base, "state": None, "base_model": base}
    ref = checkpoints.parse_tinker_path(checkpoint)
    if ref.kind != "sampler_weights":
        raise AliasError(
            f"alias {name}: {checkpoint} is a training state; an alias serves sampler weights "
            f"(tinker://{ref.run_id}/sampler_weights/...)"
        )
    _live(ref.folder(state.checkpoints_root), checkpoint, name)
    run = checkpoints.read_run(state.checkpoints_root, ref.run_id) or {}
    owner = run.get("base_model", base)
    if owner != base and not state.accepts_base_model(owner):
        raise AliasError(
            f"alias {name}: {checkpoint} is a checkpoint of {owner!r}; this server serves {base!r}"
        )
    if training_state is None:
        sibling = f"tinker://{ref.run_id}/weights/{ref.name}"
        folder = checkpoints.parse_tinker_path(sibling).folder(state.checkpoints_root)
        training_state = sibling if checkpoints.resolve(folder) is not None else None
    elif training_state:
        sref = checkpoints.parse_tinker_path(training_state)
        if sref.kind != "weights":
            raise AliasError(f"alias {name}: state: {training_state} is not a weights/ state")
        _live(sref.folder(state.checkpoints_root), training_state, name)
    for path in (checkpoint, training_state):
        if path:  # an alias keeps what it names: no TTL
            checkpoints.edit_meta(
                checkpoints.parse_tinker_path(path).folder(state.checkpoints_root),
                expires_at=None,
            )
    return {"checkpoint": checkpoint, "state": training_state or None, "base_model": base}


def _live(folder, path: str, name: str) -> None:
    if checkpoints.resolve(folder) is None:
        raise MissingCheckpoint(f"alias {name}: no checkpoint at {path} on this server")
