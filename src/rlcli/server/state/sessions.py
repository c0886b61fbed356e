"""The server's settings and state: one object the routers read from ``request.app.state``.

``ServerState`` holds what the HTTP process knows (sessions, training clients, sampling sessions,
the futures, the handle on the engine) and the lookups that answer 404 for unknown ids, so the
routers stay declarative. It imports no torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

from rlcli import checkpoint_format
from rlcli.home import checkpoints_dir
from rlcli.models.names import resolve_model_name
from rlcli.server.engine import ops
from rlcli.server.state.aliases import Aliases
from rlcli.server.state.capture import Capture
from rlcli.server.state.engine_client import EngineClient, EngineUnavailable
from rlcli.server.state.futures import FutureStore
from rlcli.server.store import checkpoints
from rlcli.server.store.archives import Archives

log = logging.getLogger("rlcli.server")

MAX_SAMPLING_SESSIONS = 4096  # oldest dropped beyond this (each is a few hundred bytes)
SEEN_REQUESTS = 256  # per training client: how far back a retried seq_id is recognised


@dataclass
class Settings:
    base_model: str
    device: str = "auto"
    dtype: str = "auto"
    grad_checkpointing: bool | None = None  # recompute activations in backward; None: auto
    microbatch_tokens: int | None = None  # padded tokens per forward/backward; None: by device
    max_lora_rank: int = 64
    checkpoints_dir: str = ""
    api_key: str | None = None
    threads: int | None = None
    session_timeout: float = 300.0  # no heartbeat for this long: the session's adapters go
    max_sample_tokens: int = 16384  # the most tokens one sample request may ask for
    max_body_mb: float = 256.0  # any request body (after zstd), except restore uploads
    max_upload_gb: float = 16.0  # a restore upload (a LoRA state: adapter + AdamW moments)
    compile: bool | None = None  # compile the decode step; None: unless RLCLI_COMPILE=0
    capture: str | None = None  # the capture folder (None: capture off)
    capture_tinker: bool = False  # capture Tinker asample requests too
    capture_redact: bool = False  # redact each record before it is written
    capture_max_mb: float = 256.0  # a capture file's size before the next one starts
    checkpoint_ttl: str = "client"  # --checkpoint-ttl (checkpoint_format.parse_checkpoint_ttl)

    @property
    def checkpoint_ttl_rule(self) -> str | float:
        return checkpoint_format.parse_checkpoint_ttl(self.checkpoint_ttl)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_gb * (1 << 30))

    def engine_settings(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "device": self.device,
            "dtype": self.dtype,
            "grad_checkpointing": self.grad_checkpointing,
            "microbatch_tokens": self.microbatch_tokens,
            "max_lora_rank": self.max_lora_rank,
            "compile": self.compile,
            "threads": self.threads,
        }


@dataclass
class ModelRecord:
    model_id: str
    session_id: str
    base_model: str
    lora: dict[str, Any]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    critic: bool = False  # model_role "critic": a value head, trained with ppo_critic
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)
    requests: int = 0  # operations queued for it (load_weights must be the first)
    # seq_id -> (payload digest, the future answered): a retried request is not run twice.
    seen: OrderedDict[int, tuple[str, dict]] = field(default_factory=OrderedDict)


@dataclass
class SessionRecord:
    session_id: str
    tags: list[str]
    sdk_version: str
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: str | None = None  # the reason a tinker>=0.38 client gave when it closed


@dataclass
class SamplerRef:
    """What a sampling session samples from: the engine's sampler key (None: base model)."""

    key: str | None
    base_model: str
    session_id: str | None
    model_path: str | None = None


class ServerState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.time()
        self.futures = FutureStore()
        self.engine = EngineClient(settings.engine_settings(), self.futures)
        self.sessions: dict[str, SessionRecord] = {}
        self.models: dict[str, ModelRecord] = {}
        self.sampling_sessions: OrderedDict[str, SamplerRef] = OrderedDict()
        # Training clients of finished sessions: asked for again, they answer 410, not 404.
        self.finished_models: OrderedDict[str, str] = OrderedDict()
        self.archives: dict[str, tuple[Path, float]] = {}  # download token -> (name, expiry)
        self.checkpoints_root = Path(settings.checkpoints_dir or checkpoints_dir())
        self.capture: Capture | None = None
        if settings.capture is not None:  # CaptureError: one line, before anything starts
            self.capture = Capture(
                settings.capture, max_mb=settings.capture_max_mb,
                redact=settings.capture_redact, tinker=settings.capture_tinker,
            )  # fmt: skip
        self.checkpoints_root.mkdir(parents=True, exist_ok=True)
        self.aliases = Aliases(self.checkpoints_root)  # model names for served checkpoints
        self.tars = Archives(self.checkpoints_root / checkpoints.STAGING / "archives")
        self.chat_tokenizer: Any = None  # the OpenAI endpoint's (routes_openai.tokenizer)
        self.chat_tokenizer_lock = asyncio.Lock()

    def authorised(self, request: Request) -> bool:
        """The request carries this server's API key (any key when it has none), as
        ``X-API-Key`` or ``Authorization: Bearer``, compared in constant time."""
        key = self.settings.api_key
        if not key:
            return True
        sent = request.headers.get("x-api-key")
        bearer = request.headers.get("authorization", "")
        if sent is None and bearer[:7].lower() == "bearer ":  # what OpenAI clients send
            sent = bearer[7:].strip()
        return sent is not None and hmac.compare_digest(sent.encode(), key.encode())

    def submit(self, op: ops.Op, model_id: str | None = None) -> dict[str, Any]:
        """Queue ``op`` on the engine; the future the client polls (503 if the engine is gone)."""
        try:
            request_id = self.engine.submit(op)
        except EngineUnavailable as e:
            raise engine_gone(str(e)) from None
        return {"request_id": request_id, "model_id": model_id}

    def submit_for(
        self, record: ModelRecord, op: ops.Op, seq_id: int | None, payload: bytes
    ) -> dict[str, Any]:
        """Queue a training client's operation, at most once per ``seq_id``.

        The SDK numbers each client's requests (``seq_id``) and resends the same request after
        a dropped connection: that retry gets the original future instead of running again (a
        twice-applied optimizer step would silently corrupt training). A ``seq_id`` reused for a
        different payload is a 409."""
        digest = hashlib.sha256(payload).hexdigest()
        if seq_id:
            seen = record.seen.get(seq_id)
            if seen is not None:
                if seen[0] == digest:
                    return seen[1]
                raise HTTPException(
                    409, f"seq_id: sequence number {seq_id} was reused for a different request"
                )
        future = self.submit(op, record.model_id)
        record.requests += 1
        if seq_id:
            record.seen[seq_id] = (digest, future)
            while len(record.seen) > SEEN_REQUESTS:
                record.seen.popitem(last=False)
        return future

    def engine_info(self) -> dict[str, Any]:
        """The loaded model's facts; 503 while it is still loading (the client retries 5xx)."""
        if self.engine.error:
            raise engine_gone(self.engine.error)
        if self.engine.info is None:
            raise HTTPException(503, "the base model is still loading; retry shortly")
        return self.engine.info

    def model(self, model_id: str) -> ModelRecord:
        record = self.models.get(model_id)
        if record is None:
            if model_id in self.finished_models:
                raise HTTPException(
                    410, f"model_id: {model_id!r} belonged to a session that has finished"
                )
            raise HTTPException(404, f"model_id: unknown model {model_id!r}")
        record.last_request = time.time()
        return record

    def session(self, session_id: str) -> SessionRecord:
        """A live session; 404 if unknown, 410 once its client finished it."""
        record = self.sessions.get(session_id)
        if record is None:
            raise HTTPException(404, f"session_id: unknown session {session_id!r}")
        if record.finished:
            raise HTTPException(
                410, f"session_id: session {session_id} has finished ({record.finished})"
            )
        return record

    def session_of_sampler(self, ref: SamplerRef) -> SessionRecord | None:
        return self.sessions.get(ref.session_id) if ref.session_id else None

    def finish_session(self, session_id: str, reason: str) -> None:
        """The client closed its session (tinker>=0.38): its training clients and sampling
        sessions go, as on expiry; the first reason given stays."""
        record = self.sessions.get(session_id)
        if record is None:
            raise HTTPException(404, f"session_id: unknown session {session_id!r}")
        if record.finished:
            return
        record.finished = reason
        self._drop_session_clients(session_id, finished=True)
        log.info("session %s finished: %s", session_id, reason)

    def add_sampling_session(self, session_id: str, ref: SamplerRef) -> None:
        self.sampling_sessions[session_id] = ref
        while len(self.sampling_sessions) > MAX_SAMPLING_SESSIONS:
            self.sampling_sessions.popitem(last=False)

    def accepts_base_model(self, name: str) -> bool:

        return name == self.settings.base_model or resolve_model_name(name) == (
            self.settings.base_model
        )

    def check_base_model(self, name: str | None) -> None:
        if not name or not self.accepts_base_model(name):
            raise HTTPException(
                400,
                f"base_model: {name!r} is not served here; this server serves "
                f"{self.settings.base_model!r}",
            )

    def expire_sessions(self) -> None:
        """Drop sessions silent for longer than the timeout, with their training clients
        (adapters freed in the engine) and sampling sessions."""
        now = time.time()
        for session in list(self.sessions.values()):
            if now - session.last_heartbeat <= self.settings.session_timeout:
                continue
            del self.sessions[session.session_id]
            if not session.finished:
                self._drop_session_clients(session.session_id, finished=False)
                log.info("session %s expired: no heartbeat", session.session_id)

    def _drop_session_clients(self, session_id: str, finished: bool) -> None:
        """Free the session's adapters and sampling sessions; a finished session's training
        clients answer 410 afterwards, an expired one's 404 (as before 0.38)."""
        for record in list(self.models.values()):
            if record.session_id == session_id:
                del self.models[record.model_id]
                if finished:
                    self.finished_models[record.model_id] = session_id
                    while len(self.finished_models) > MAX_SAMPLING_SESSIONS:
                        self.finished_models.popitem(last=False)
                if self.engine.healthy:
                    self.engine.submit(ops.RemoveAdapter(record.model_id))
                log.info("Auto-unloaded model %s; Deleted model", record.model_id)
        for sampler_id, ref in list(self.sampling_sessions.items()):
            if ref.session_id == session_id:
                del self.sampling_sessions[sampler_id]


def engine_gone(reason: str) -> HTTPException:
    """503 that tells the SDK not to retry: nothing will answer until the server restarts."""
    return HTTPException(503, f"engine unavailable: {reason}", headers={"x-should-retry": "false"})


async def housekeeping(
    state: ServerState, every_s: float | None = None, sweep_every_s: float = 30.0
) -> None:
    """Expire silent sessions, and sweep expired or superseded checkpoints, forever.

    Invariant: housekeeping cannot die. Each chore is guarded: an exception is logged (once
    per distinct error) and the loop goes on, so sessions keep expiring and TTLs keep being
    applied for the server's life."""
    timeout = state.settings.session_timeout
    period = every_s or max(0.5, min(15.0, timeout / 4))
    last_sweep = 0.0
    reported: set[str] = set()

    def report(chore: str, error: Exception) -> None:
        what = f"{chore}: {type(error).__name__}: {error}"
        if what not in reported:
            reported.add(what)
            log.error("housekeeping: %s (logged once; housekeeping goes on)", what, exc_info=error)

    while True:
        await asyncio.sleep(period)
        try:
            state.expire_sessions()
        except Exception as e:
            report("session expiry", e)
        if time.monotonic() - last_sweep > sweep_every_s:
            last_sweep = time.monotonic()
            try:
                await asyncio.to_thread(checkpoints.sweep, state.checkpoints_root)
            except Exception as e:
                report("checkpoint sweep", e)


def server_state(request: Request) -> ServerState:
    return request.app.state.rlcli


State = Annotated[ServerState, Depends(server_state)]
