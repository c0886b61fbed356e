"""The HTTP process of the torch backend: a FastAPI app over the Tinker API (every SDK
generation from 0.25 on) and the OpenAI-compatible ``/v1``.

Routers (``tinker/*.py``, ``openai/routes.py``) validate typed bodies (``tinker/schemas.py``),
record state (``state/sessions.py``) and queue typed operations on the engine process
(``engine/ops.py``, ``state/engine_client.py``); results come back through
``retrieve_future``. This module wires them together and owns the answers to errors: a bad
body is a 400 naming the field, anything unexpected a JSON 500, never a dropped connection.
If the engine dies the server answers what it can for a few seconds, then exits non-zero so a
supervisor brings up a fresh one (``__main__.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlcli.server.errors import UserError
from rlcli.server.http import aliases as routes_aliases
from rlcli.server.http import d2l as routes_d2l
from rlcli.server.http.openai import feedback as routes_feedback
from rlcli.server.http.openai import routes as routes_openai
from rlcli.server.http.tinker import checkpoints as routes_checkpoints
from rlcli.server.http.tinker import rest as routes_rest
from rlcli.server.http.tinker import sampling as routes_sampling
from rlcli.server.http.tinker import service as routes_service
from rlcli.server.http.tinker import training as routes_training
from rlcli.server.http.tinker.schemas import first_error
from rlcli.server.state.sessions import ServerState, Settings, housekeeping
from rlcli.server.store import checkpoints

log = logging.getLogger("rlcli.server")

DRAIN_S = 5.0  # after the engine dies: time for polling clients to collect their errors
EXIT_ENGINE_DIED = 3


def create_app(settings: Settings) -> FastAPI:
    state = ServerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        state.futures.bind(loop)
        checkpoints.sweep(state.checkpoints_root, grace=0)  # nobody reads yet; never raises
        checkpoints.clear_staging(state.checkpoints_root)
        state.engine.on_death = lambda reason: loop.call_soon_threadsafe(_exit_soon, app, loop)
        state.engine.start()
        task = asyncio.create_task(housekeeping(state))
        yield
        task.cancel()
        if state.capture is not None:  # after uvicorn finished the requests in flight
            state.capture.close()
        state.engine.stop()

    app = FastAPI(title="rlcli torch backend", lifespan=lifespan)
    app.add_middleware(BodyLimit, settings=settings)
    app.state.rlcli = state
    app.state.exit_code = 0

    async def check_api_key(request: Request) -> None:
        if state.authorised(request):
            return
        sent = ("x-api-key", "authorization")
        if not any(request.headers.get(name) for name in sent):
            raise HTTPException(
                401, "X-API-Key: missing; this server needs an API key (or Authorization: Bearer)"
            )
        raise HTTPException(403, "X-API-Key: wrong API key")

    guarded = [Depends(check_api_key)]
    app.include_router(routes_service.public)
    app.include_router(routes_rest.public)
    for module in (
        routes_service,
        routes_training,
        routes_sampling,
        routes_checkpoints,
        routes_rest,
        routes_openai,
        routes_aliases,
        routes_d2l,
        routes_feedback,
    ):
        app.include_router(module.router, dependencies=guarded)

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError):
        if _openai(request.url.path):
            status = 400 if exc.status == 422 else exc.status
            return _openai_error(request, status, str(exc), getattr(exc, "param", None),
                                 getattr(exc, "code", None))  # fmt: skip
        return JSONResponse({"detail": str(exc)}, exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        if _openai(request.url.path):
            errors = exc.errors()
            first = errors[0] if errors else {}
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            param = None if first.get("type") == "json_invalid" else ".".join(loc) or None
            return _openai_error(request, 400, first_error(errors), param)
        return JSONResponse({"detail": first_error(exc.errors())}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if _openai(request.url.path):
            return _openai_error(request, exc.status_code, str(exc.detail), None, None,
                                 getattr(exc, "headers", None))  # fmt: skip
        return await http_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        message = f"internal error: {type(exc).__name__}: {exc}"
        if _openai(request.url.path):
            return _openai_error(request, 500, message)
        return JSONResponse({"detail": message}, 500)

    return app


def _openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def openai_error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error shape, which its clients parse."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status in (401, 403):
        kind, code = "authentication_error", code or "invalid_api_key"
    if status == 404 and code is None:
        code = "not_found"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _openai_error(
    request: Request, status: int, message: str, param: str | None = None,
    code: str | None = None, headers: dict | None = None,
) -> JSONResponse:  # fmt: skip
    """Every error of a /v1 path: OpenAI's shape, and one line in the server log."""
    log.info("%s %s: %d %s", request.method, request.url.path, status, message)
    return JSONResponse(openai_error_body(status, message, param, code), status, headers=headers)


class BodyLimit:
    """Every request body has a cap before it is read (the one owner of body sizes): a
    ``Content-Length`` over it is answered 413 at once, and a body streamed without one is
    counted as it arrives and refused with a 413 the moment it passes the cap, so no route ever
    holds more than the cap in memory or on disk. Restore uploads (``routes_rest.UPLOADS``) get
    ``--max-upload-gb``, everything else ``--max-body-mb``."""

    def __init__(self, app, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload = scope["path"].startswith(routes_rest.UPLOADS)
        cap = self.settings.max_upload_bytes if upload else self.settings.max_body_bytes
        flag = "--max-upload-gb" if upload else "--max-body-mb"
        detail = f"body: larger than this server's cap of {cap} bytes ({flag})"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > cap:
            body = openai_error_body(413, detail) if _openai(scope["path"]) else {"detail": detail}
            return await JSONResponse(body, 413)(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > cap:  # handled as any HTTPException: a 413 answer
                raise HTTPException(413, detail)
            return message

        await self.app(scope, counted, send)


def _exit_soon(app: FastAPI, loop: asyncio.AbstractEventLoop) -> None:
    """The engine is gone: answer for DRAIN_S seconds (errors and 503s), then stop uvicorn."""
    app.state.exit_code = EXIT_ENGINE_DIED
    log.error("the engine is gone; the server exits in %.0f s", DRAIN_S)
    loop.call_later(DRAIN_S, os.kill, os.getpid(), signal.SIGTERM)
