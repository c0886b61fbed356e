"""The HTTP layer of the torch backend: the Tinker API routes of the pinned 0.25.0 client.

Routes only validate, record and enqueue; the engine process computes. Training work comes
back through futures (``retrieve_future``), as the client expects. Wire formats live in
``wire.py``, request checks in ``validate.py``, the losses in ``losses.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from rlcli import compat
from rlcli.home import rlcli_home
from rlcli.server import checkpoints, losses, routes_rest, routes_weights, wire
from rlcli.server.engine_client import EngineClient
from rlcli.server.futures import FutureStore
from rlcli.server.validate import RequestError, validate_forward_backward

log = logging.getLogger("rlcli.server")

POLL_SECONDS = 35.0  # long-poll window of retrieve_future; the client waits up to 45 s


@dataclass
class Settings:
    base_model: str
    device: str = "auto"
    dtype: str = "auto"
    max_lora_rank: int = 64
    checkpoints_dir: str = ""
    api_key: str | None = None
    threads: int | None = None
    session_timeout: float = 300.0  # no heartbeat for this long: the session's adapters go

    def engine_settings(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "device": self.device,
            "dtype": self.dtype,
            "max_lora_rank": self.max_lora_rank,
            "threads": self.threads,
        }


@dataclass
class ModelRecord:
    model_id: str
    session_id: str
    base_model: str
    lora: dict[str, Any]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)


@dataclass
class SessionRecord:
    session_id: str
    tags: list[str]
    sdk_version: str
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)


class ServerState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.time()
        self.futures = FutureStore()
        self.engine = EngineClient(settings.engine_settings(), self.futures)
        self.sessions: dict[str, SessionRecord] = {}
        self.models: dict[str, ModelRecord] = {}
        self.sampling_sessions: dict[str, routes_weights.SamplerRef] = {}
        self.checkpoints_root = Path(settings.checkpoints_dir or rlcli_home() / "checkpoints")
        self.checkpoints_root.mkdir(parents=True, exist_ok=True)

    def engine_info(self) -> dict[str, Any]:
        """The loaded model's facts; 503 while it is still loading (the client retries 5xx)."""
        if self.engine.error:
            raise HTTPException(503, f"engine unavailable: {self.engine.error}")
        if self.engine.info is None:
            raise HTTPException(503, "the base model is still loading; retry shortly")
        return self.engine.info

    def model(self, model_id: str) -> ModelRecord:
        record = self.models.get(model_id)
        if record is None:
            raise HTTPException(404, f"model_id: unknown model {model_id!r}")
        record.last_request = time.time()
        return record

    def session(self, session_id: str) -> SessionRecord:
        record = self.sessions.get(session_id)
        if record is None:
            raise HTTPException(404, f"session_id: unknown session {session_id!r}")
        return record

    def accepts_base_model(self, name: str) -> bool:
        from rlcli.models import resolve_model_name

        return name == self.settings.base_model or resolve_model_name(name) == (
            self.settings.base_model
        )


async def _reap_sessions(state: ServerState) -> None:
    """Free the adapters of sessions whose client went away (the SDK heartbeats every 10 s).

    Without this, every training client ever created would hold its LoRA weights and
    optimizer state until the server stops."""
    timeout = state.settings.session_timeout
    while True:
        await asyncio.sleep(max(0.5, min(15.0, timeout / 4)))
        now = time.time()
        for session in list(state.sessions.values()):
            if now - session.last_heartbeat <= timeout:
                continue
            del state.sessions[session.session_id]
            for record in list(state.models.values()):
                if record.session_id == session.session_id:
                    del state.models[record.model_id]
                    state.engine.submit("unload_model", "remove_adapter", name=record.model_id)
            log.info("session %s expired: no heartbeat for %.0fs", session.session_id, timeout)


def _future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


def create_app(settings: Settings) -> FastAPI:
    state = ServerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.futures.bind(asyncio.get_running_loop())
        state.engine.start()
        reaper = asyncio.create_task(_reap_sessions(state))
        yield
        reaper.cancel()
        state.engine.stop()

    app = FastAPI(title="rlcli torch backend", lifespan=lifespan)
    app.state.rlcli = state

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        path = request.url.path  # health stays open: probes and `serve status` carry no key
        guarded = settings.api_key and path.startswith("/api/v1/") and path != "/api/v1/healthz"
        if guarded and request.headers.get("x-api-key") != settings.api_key:
            return JSONResponse({"detail": "X-API-Key: wrong or missing API key"}, 401)
        return await call_next(request)

    # ---- handshake, sessions, capabilities --------------------------------------------
    @app.get("/api/v1/healthz")
    async def healthz():
        if not state.engine.healthy:
            reason = state.engine.error or "loading the base model"
            return JSONResponse({"status": "unavailable", "detail": reason}, 503)
        return {"status": "ok"}

    @app.get("/rlcli/status")
    async def status():
        """What ``rlcli serve status`` shows: one JSON document, no side effects."""
        return {
            "healthy": state.engine.healthy,
            "error": state.engine.error,
            "base_model": settings.base_model,
            "backend": "torch",
            "uptime_s": round(time.time() - state.started, 1),
            "engine": state.engine.info,
            "sessions": len(state.sessions),
            "models": len(state.models),
            "pending_requests": state.futures.pending_count,
            "versions": compat.installed_versions(),
        }

    @app.post("/api/v1/client/config")
    async def client_config(body: dict):
        return compat.CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(body: dict):
        return {"refresh_interval_sec": 300}

    @app.post("/api/v1/telemetry")
    async def telemetry(body: dict):
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session(body: dict):
        session_id = str(uuid.uuid4())
        state.sessions[session_id] = SessionRecord(
            session_id, list(body.get("tags") or []), str(body.get("sdk_version", ""))
        )
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(body: dict):
        state.session(str(body.get("session_id"))).last_heartbeat = time.time()
        return {"type": "session_heartbeat"}

    @app.get("/api/v1/get_server_capabilities")
    async def get_server_capabilities():
        info = state.engine.info or {}
        return {
            "supported_models": [
                {"model_name": settings.base_model, "max_context_length": info.get("max_context")}
            ],
            # Not part of the 0.25.0 schema (the client ignores it): lets rlcli's loss guard
            # ask this server what it computes instead of probing.
            "supported_loss_fns": sorted(losses.LOSSES),
            "backend": "torch",
        }

    @app.get("/api/v1/sessions")
    async def list_sessions():
        return {"sessions": list(state.sessions)}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str):
        state.session(session_id)
        runs = [m.model_id for m in state.models.values() if m.session_id == session_id]
        return {"training_run_ids": runs, "sampler_ids": []}

    # ---- models ----------------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(body: dict):
        info = state.engine_info()
        session_id = str(body.get("session_id"))
        state.session(session_id)
        base_model = str(body.get("base_model", ""))
        if not state.accepts_base_model(base_model):
            raise HTTPException(
                400,
                f"base_model: {base_model!r} is not served here; this server serves "
                f"{settings.base_model!r}",
            )
        lora = dict(body.get("lora_config") or {"rank": 32})
        rank = lora.get("rank")
        if not isinstance(rank, int) or not 1 <= rank <= info["max_lora_rank"]:
            raise HTTPException(
                400,
                f"lora_config.rank: {rank!r} is outside 1..{info['max_lora_rank']} "
                "(raise it with `rlcli serve start --max-lora-rank N`)",
            )
        if not any(lora.get(k, True) for k in ("train_mlp", "train_attn", "train_unembed")):
            raise HTTPException(
                400, "lora_config: train_mlp, train_attn and train_unembed are all off"
            )
        model_id = f"{uuid.uuid4()}"
        record = ModelRecord(
            model_id, session_id, settings.base_model, lora, dict(body.get("user_metadata") or {})
        )
        state.models[model_id] = record
        checkpoints.write_run(
            state.checkpoints_root,
            model_id,
            {
                "training_run_id": model_id,
                "base_model": record.base_model,
                "lora": {"rank": rank, **{k: v for k, v in lora.items() if k != "rank"}},
                "session_id": session_id,
                "user_metadata": record.user_metadata,
                "created": record.created,
            },
        )
        request_id = state.engine.submit(
            "create_model",
            "create_adapter",
            name=model_id,
            rank=rank,
            seed=lora.get("seed"),
            train_mlp=lora.get("train_mlp", True),
            train_attn=lora.get("train_attn", True),
            train_unembed=lora.get("train_unembed", True),
        )
        return _future(request_id, model_id)

    @app.post("/api/v1/get_info")
    async def get_info(body: dict):
        record = state.model(str(body.get("model_id")))
        return {
            "type": "get_info",
            "model_id": record.model_id,
            "model_data": {
                "arch": "lora",
                "model_name": record.base_model,
                # A local folder path is a tokenizer id AutoTokenizer loads offline.
                "tokenizer_id": record.base_model,
            },
            "is_lora": True,
            "lora_rank": record.lora.get("rank"),
            "model_name": record.base_model,
        }

    @app.post("/api/v1/unload_model")
    async def unload_model(body: dict):
        model_id = str(body.get("model_id"))
        state.model(model_id)
        del state.models[model_id]
        request_id = state.engine.submit("unload_model", "remove_adapter", name=model_id)
        return _future(request_id, model_id)

    # ---- training --------------------------------------------------------------------------
    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        info = state.engine_info()
        body = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            import zstandard

            body = zstandard.ZstdDecompressor().decompress(body)
        if wire.PROTO_CONTENT_TYPE not in request.headers.get("content-type", ""):
            raise HTTPException(
                415, f"forward_backward takes a {wire.PROTO_CONTENT_TYPE} body (tinker>=0.25)"
            )
        try:
            req = wire.decode_forward_backward(body)
        except wire.WireError as e:
            raise HTTPException(400, str(e)) from None
        state.model(req.model_id)
        try:
            validate_forward_backward(req, info["vocab_size"], info["max_context"])
        except RequestError as e:
            raise HTTPException(400, str(e)) from None
        request_id = state.engine.submit(
            "forward_backward",
            "forward_backward",
            model_id=req.model_id,
            data=req.data,
            loss_fn=req.loss_fn,
            loss_fn_config=req.loss_fn_config,
            forward_only=req.forward_only,
        )
        return _future(request_id, req.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(body: dict):
        state.engine_info()
        model_id = str(body.get("model_id"))
        state.model(model_id)
        adam = dict(body.get("adam_params") or {})
        allowed = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"}
        unknown = sorted(set(adam) - allowed)
        if unknown:
            raise HTTPException(400, f"adam_params: unknown field(s) {unknown}")
        for key, value in adam.items():
            if not isinstance(value, int | float) or value < 0:
                raise HTTPException(400, f"adam_params.{key}: {value!r} is not a number >= 0")
        request_id = state.engine.submit("optim_step", "optim_step", model_id=model_id, **adam)
        return _future(request_id, model_id)

    routes_weights.register(app, state)
    routes_rest.register(app, state)

    # ---- futures ---------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await request.json()
        request_id = str(body.get("request_id"))
        if not state.futures.known(request_id):
            raise HTTPException(404, f"request_id: unknown request {request_id!r}")
        outcome = await state.futures.wait(request_id, POLL_SECONDS)
        if outcome is None:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if outcome.status != "ok":
            return {"error": outcome.value, "category": outcome.status}
        accept_proto = wire.PROTO_CONTENT_TYPE in request.headers.get("accept", "")
        return _encode_result(outcome.kind, outcome.value, accept_proto)

    return app


def _encode_result(kind: str, value: Any, accept_proto: bool):
    if kind == "forward_backward":
        outputs, metrics = value
        if accept_proto:
            return Response(
                wire.encode_forward_backward_output(outputs, metrics),
                media_type=wire.PROTO_CONTENT_TYPE,
            )
        return wire.forward_backward_output_json(outputs, metrics)
    if kind == "optim_step":
        return {"metrics": value}
    if kind == "create_model":
        return {"type": "create_model", "model_id": value["model_id"]}
    if kind == "unload_model":
        return {"type": "unload_model", "model_id": value["model_id"]}
    if kind == "sample":
        if accept_proto:
            return Response(wire.encode_sample_response(value), media_type=wire.PROTO_CONTENT_TYPE)
        return wire.sample_response_json(value)
    if kind == "save_weights":
        return {"type": "save_weights", "path": value["path"]}
    if kind == "save_sampler_weights":
        return {"type": "save_weights_for_sampler", "path": value["path"]}
    if kind == "save_weights_for_sampler":  # ephemeral snapshot: a sampling session id
        session_id = value["key"].removeprefix("ephemeral:")
        return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": session_id}
    if kind == "load_weights":
        return {"type": "load_weights", "path": value["path"], "model_id": value["model_id"]}
    return value
