"""Routes of the service itself: health, status, the client handshake, sessions, capabilities,
and ``retrieve_future``, the one place a queued operation's result is answered."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from rlcli.server import wire
from rlcli.server.engine import losses
from rlcli.server.http.tinker import generations
from rlcli.server.http.tinker.schemas import (
    CreateSession,
    FinishSession,
    RetrieveFuture,
    SessionRef,
)
from rlcli.server.state.sessions import SessionRecord, State
from rlcli.versions import installed_versions

POLL_SECONDS = 35.0  # long-poll window of retrieve_future; the client waits up to 45 s

public = APIRouter()  # no API key: probes and `rlcli serve status` carry none
router = APIRouter(prefix="/api/v1")


@public.get("/api/v1/healthz")
async def healthz(state: State):
    if not state.engine.healthy:
        reason = state.engine.error or "loading the base model"
        return JSONResponse({"status": "unavailable", "detail": reason}, 503)
    return {"status": "ok"}


@public.get("/rlcli/status")
async def status(request: Request, state: State):
    """What ``rlcli serve status`` shows: one JSON document, no side effects. Model paths,
    counts and versions only to a client with the API key; others learn it is up."""
    brief = {
        "healthy": state.engine.healthy,
        "backend": "torch",
        "uptime_s": round(time.time() - state.started, 1),
    }
    if not state.authorised(request):
        return brief
    return {
        **brief,
        "error": state.engine.error,
        "base_model": state.settings.base_model,
        "engine": state.engine.info,
        "sessions": len(state.sessions),
        "models": len(state.models),
        "sampling_sessions": len(state.sampling_sessions),
        "pending_requests": state.futures.pending_count,
        "versions": installed_versions(),
    }


@router.post("/client/config")
async def client_config():
    return generations.CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def client_dynamic_config():
    return {"refresh_interval_sec": 300}


@router.post("/telemetry")
async def telemetry():
    return {"status": "accepted"}


@router.post("/create_session")
async def create_session(body: CreateSession, state: State):
    session_id = str(uuid.uuid4())
    state.sessions[session_id] = SessionRecord(session_id, list(body.tags), body.sdk_version)
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(body: SessionRef, state: State):
    state.session(body.session_id).last_heartbeat = time.time()  # 410 once finished
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, body: FinishSession, state: State):
    """tinker>=0.38 ``ServiceClient.close(status)``: the session ends, first reason wins."""
    reason = body.reason.type + (f": {body.detail}" if body.detail else "")
    state.finish_session(session_id, reason)
    return {"type": "finish_session", "session_id": session_id}


@router.get("/get_server_capabilities")
async def get_server_capabilities(state: State):
    info = state.engine.info or {}
    return {
        "supported_models": [
            {"model_name": state.settings.base_model, "max_context_length": info.get("max_context")}
        ],
        # Not part of the 0.25.0 schema (the client ignores them): let rlcli's checks ask this
        # server what it computes and accepts instead of probing.
        "supported_loss_fns": sorted(losses.LOSSES),
        "loss_fn_config": losses.config_defaults(),
        "max_lora_rank": state.settings.max_lora_rank,
        "lora_alpha": True,  # takes user_metadata.rlcli_lora_alpha (schemas.LORA_ALPHA_METADATA)
        "packing": losses.PACKING_INPUT,  # packed datums' segment ids (train sl --pack)
        "max_sample_tokens": state.settings.max_sample_tokens,
        "backend": "torch",
        # rlcli's own doc-to-LoRA routes (http/d2l.py): hypernetworks on this base model.
        "hypernetworks": {"routes": "/api/v1/rlcli/hypernets", "target_modules": ["down_proj"]},
    }


@router.get("/sessions")
async def list_sessions(state: State, limit: int = 20, offset: int = 0):
    newest_first = list(state.sessions)[::-1]
    return {"sessions": newest_first[max(0, offset) : max(0, offset) + max(0, limit)]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, state: State):
    state.session(session_id)
    runs = [m.model_id for m in state.models.values() if m.session_id == session_id]
    samplers = [s for s, ref in state.sampling_sessions.items() if ref.session_id == session_id]
    return {"training_run_ids": runs, "sampler_ids": samplers}


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFuture, request: Request, state: State):
    try:
        outcome = await state.futures.wait(body.request_id, POLL_SECONDS)
    except KeyError:
        raise HTTPException(404, f"request_id: unknown request {body.request_id!r}") from None
    if outcome is None:
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    if outcome.status != "ok":
        return {"error": outcome.value, "category": outcome.status}
    accept_proto = wire.PROTO_CONTENT_TYPE in request.headers.get("accept", "")
    try:
        return outcome.op.answer(outcome.value, accept_proto)
    except Exception as e:  # an answer that cannot be encoded must still be an answer
        return {"error": f"the result could not be encoded: {e}", "category": "server"}
