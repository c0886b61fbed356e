"""rlcli's own routes for doc-to-LoRA hypernetworks, beside the Tinker API (which has none).

``/api/v1/rlcli/hypernets``: create a hypernetwork on this server's base model, train it a
step at a time on (document, question, answer) examples, save it as
``tinker://<id>/hypernet_weights/<name>``, load one back (resume); ``/api/v1/rlcli/internalize``
turns a document into a sampler checkpoint, ``tinker://<id>.docs/sampler_weights/<name>``, in
one forward pass. The server advertises them in ``get_server_capabilities``
(``"hypernetworks"``). Each route waits for its engine operation (``engine/d2l_ops.py``) and
answers its result: these are rlcli's own calls, not the SDK's futures. A refusal is a 4xx
with one line naming the field; the engine does the work (``engine/d2l.py``).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException
from pydantic import Field

from rlcli.checkpoint_format import TinkerPathError, check_name
from rlcli.server.engine import d2l_ops
from rlcli.server.engine.ops import Op
from rlcli.server.http.tinker.schemas import Body, Seed
from rlcli.server.state.sessions import ServerState, State
from rlcli.server.store import checkpoints

router = APIRouter(prefix="/api/v1/rlcli")

KIND = "hypernet_weights"  # the engine's d2l.KIND; the engine module is not imported here
DOCS_SUFFIX = ".docs"  # the run that holds a hypernetwork's internalized documents
DEFAULT_TTL_S = 24 * 3600  # an internalized adapter lives a day unless pinned or renewed
POLL_S = 30.0
Text = Annotated[str, Field(max_length=4_000_000)]


class CreateHypernet(Body):
    base_model: str | None = None
    seed: Seed | None = None
    rank: Annotated[int, Field(ge=1, le=64)] = 8
    latent: Annotated[int, Field(ge=4, le=1024)] = 64
    heads: Annotated[int, Field(ge=1, le=32)] = 4
    alpha: Annotated[float, Field(gt=0)] = 16.0
    chunk_tokens: Annotated[int, Field(ge=8, le=8192)] = 512
    max_chunks: Annotated[int, Field(ge=1, le=64)] = 8
    lora_layers: Annotated[int, Field(ge=0, le=4096)] = 0  # the last N layers (0: all)


class Example(Body):
    document: Text
    question: Annotated[str, Field(min_length=1, max_length=100_000)]
    answer: Annotated[str, Field(min_length=1, max_length=100_000)]
    # Training: read the document as this many pieces of about equal length (the engine's
    # split_ids), so the hypernetwork learns how its chunks' LoRAs add up. Default: as
    # internalizing reads it, chunks of chunk_tokens.
    chunks: Annotated[int, Field(ge=1, le=64)] | None = None


class Step(Body):
    examples: Annotated[list[Example], Field(min_length=1, max_length=1024)]
    lr: Annotated[float, Field(gt=0, le=1)] = 1e-3
    l1: Annotated[float, Field(ge=0)] = 0.0
    train: bool = True


class Save(Body):
    name: str


class Load(Body):
    path: str
    hypernet_id: str | None = None  # keep the saved run's id (a resume); default: a new one
    optimizer: bool = True


class Internalize(Body):
    hypernet: str  # tinker://<id>/hypernet_weights/<name>, or a training hypernet_id
    document: Text
    name: str | None = None
    session_key: Annotated[str, Field(min_length=1, max_length=1000)] | None = None
    ttl_seconds: Annotated[int, Field(ge=1)] | None = None
    pin: bool = False


async def _run(state: ServerState, op: Op) -> Any:
    """Queue ``op`` and wait for its result: a user error is a 400, anything else a 500."""
    state.engine_info()
    request_id = state.submit(op)["request_id"]
    while True:
        outcome = await state.futures.wait(request_id, POLL_S)
        if outcome is not None:
            break
    if outcome.status == "user":
        raise HTTPException(400, str(outcome.value))
    if outcome.status != "ok":
        raise HTTPException(500, str(outcome.value))
    return outcome.value


def hypernet_ref(path: str, field: str = "path") -> tuple[str, str]:
    """``tinker://<id>/hypernet_weights/<name>`` -> (id, name); anything else is one line
    (an adapter's path says it is an adapter)."""
    run_id, _, rest = path.removeprefix("tinker://").partition("/")
    kind, _, name = rest.partition("/")
    if not path.startswith("tinker://") or kind != KIND:
        what = f"a {kind} checkpoint (a LoRA adapter), not" if kind in checkpoints.KINDS else "not"
        raise HTTPException(
            400, f"{field}: {path} is {what} a hypernetwork path (tinker://ID/{KIND}/NAME)"
        )
    try:
        return check_name(run_id, "run_id"), check_name(name, field)
    except TinkerPathError as e:
        raise HTTPException(400, str(e)) from None


@router.post("/hypernets")
async def create(body: CreateHypernet, state: State):
    if body.base_model is not None:
        state.check_base_model(body.base_model)
    hypernet_id = f"hn-{uuid.uuid4().hex[:12]}"
    settings = body.model_dump(exclude={"base_model", "seed"})
    return await _run(state, d2l_ops.CreateHypernet(hypernet_id, settings, body.seed))


@router.post("/hypernets/{hypernet_id}/step")
async def step(hypernet_id: str, body: Step, state: State):
    examples = [e.model_dump() for e in body.examples]
    return await _run(
        state, d2l_ops.HypernetStep(hypernet_id, examples, body.lr, body.l1, body.train)
    )


@router.post("/hypernets/{hypernet_id}/save")
async def save(hypernet_id: str, body: Save, state: State):
    try:
        name = check_name(body.name, "name")
        check_name(hypernet_id, "run_id")
    except TinkerPathError as e:
        raise HTTPException(400, str(e)) from None
    path = f"tinker://{hypernet_id}/{KIND}/{name}"
    folder = state.checkpoints_root / hypernet_id / KIND / name
    meta = {
        "checkpoint_id": f"{KIND}/{name}",
        "checkpoint_type": "hypernetwork",
        "tinker_path": path,
        "training_run_id": hypernet_id,
        "base_model": state.settings.base_model,
        "expires_at": None,
        "public": False,
    }
    return await _run(state, d2l_ops.SaveHypernet(hypernet_id, str(folder), meta))


@router.post("/hypernets/load")
async def load(body: Load, state: State):
    run_id, name = hypernet_ref(body.path)
    hypernet_id = body.hypernet_id or f"hn-{uuid.uuid4().hex[:12]}"
    folder = state.checkpoints_root / run_id / KIND / name
    op = d2l_ops.LoadHypernet(hypernet_id, str(folder), body.path, body.optimizer)
    return await _run(state, op)


@router.delete("/hypernets/{hypernet_id}")
async def remove(hypernet_id: str, state: State):
    return await _run(state, d2l_ops.RemoveHypernet(hypernet_id))


@router.post("/internalize")
async def internalize(body: Internalize, state: State):
    """The document's adapter as a sampler checkpoint. With a ``session_key``, the same key
    gets the same adapter (its name is the key's hash) without recomputing it while it
    lives; each such request renews its time to live."""
    if body.hypernet.startswith("tinker://"):
        run_id, name = hypernet_ref(body.hypernet, "hypernet")
        hypernet_id, directory = None, str(state.checkpoints_root / run_id / KIND / name)
    else:
        run_id, hypernet_id, directory = body.hypernet, body.hypernet, None
    if body.session_key is not None:
        digest = hashlib.sha256(f"{body.hypernet}\0{body.session_key}".encode()).hexdigest()
        doc_name = f"key-{digest[:24]}"
    else:
        doc_name = body.name or f"doc-{uuid.uuid4().hex[:12]}"
    try:
        doc_name = check_name(doc_name, "name")
    except TinkerPathError as e:
        raise HTTPException(400, str(e)) from None
    docs_run = f"{run_id}{DOCS_SUFFIX}"
    target = state.checkpoints_root / docs_run / "sampler_weights" / doc_name
    path = f"tinker://{docs_run}/sampler_weights/{doc_name}"
    ttl = None if body.pin else (body.ttl_seconds or DEFAULT_TTL_S)
    expires_at = None if ttl is None else time.time() + ttl
    if body.session_key is not None:
        version = checkpoints.resolve(target)
        if version is not None:  # made before for this key: the same adapter, renewed
            meta = checkpoints.update_meta(version, expires_at=expires_at)
            return {"path": path, "reused": True, "expires_at": meta.get("expires_at"),
                    **{k: meta.get(k) for k in ("tokens", "chunks", "rank")}}  # fmt: skip
    _docs_run(state, docs_run, body.hypernet)
    meta = {
        "checkpoint_id": f"sampler_weights/{doc_name}",
        "checkpoint_type": "sampler",
        "tinker_path": path,
        "training_run_id": docs_run,
        "base_model": state.settings.base_model,
        "expires_at": expires_at,
        "public": False,
        "hypernet": body.hypernet,
    }
    op = d2l_ops.Internalize(
        hypernet_id, directory, body.hypernet, body.document, str(target), meta
    )
    out = await _run(state, op)
    return {**out, "reused": False, "expires_at": expires_at}


def _docs_run(state: ServerState, docs_run: str, hypernet: str) -> None:
    """The run record of a hypernetwork's internalized documents (listings and export read
    a run's base model and LoRA settings there)."""
    if checkpoints.read_run(state.checkpoints_root, docs_run) is not None:
        return
    checkpoints.write_run(state.checkpoints_root, docs_run, {
        "training_run_id": docs_run,
        "base_model": state.settings.base_model,
        "lora": {"rank": 8, "train_mlp": True, "train_attn": False, "train_unembed": False},
        "hypernet": hypernet,
        "created": time.time(),
    })  # fmt: skip
