"""Futures: the tinker pattern of "POST returns a request id, poll ``retrieve_future``".

The HTTP process owns a ``FutureStore``; the engine process's replies are fed in from a reader
thread. ``wait`` long-polls, so an idle client makes one request per ``poll_seconds`` instead of
spinning, and a finished result is answered the moment it lands.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    status: str  # "ok" | "user" | "server"
    value: Any  # the engine's return value, or an error message
    kind: str  # what was asked, e.g. "forward_backward"; decides how the value is encoded


class FutureStore:
    def __init__(self, keep_done: int = 4096) -> None:
        self._pending: dict[str, tuple[asyncio.Future, str]] = {}
        self._done: OrderedDict[str, Outcome] = OrderedDict()
        self._keep_done = keep_done
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def create(self, kind: str) -> str:
        request_id = str(uuid.uuid4())
        assert self._loop is not None, "FutureStore.bind() first"
        self._pending[request_id] = (self._loop.create_future(), kind)
        return request_id

    def resolve(self, request_id: str, status: str, value: Any) -> None:
        """Thread-safe: called from the engine reader thread."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._resolve, request_id, status, value)

    def _resolve(self, request_id: str, status: str, value: Any) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        future, kind = entry
        outcome = Outcome(status, value, kind)
        self._done[request_id] = outcome
        while len(self._done) > self._keep_done:
            self._done.popitem(last=False)
        if not future.done():
            future.set_result(outcome)

    def fail_all(self, message: str) -> None:
        """The engine died: every pending request fails with a server error."""
        for request_id in list(self._pending):
            self._resolve(request_id, "server", message)

    def known(self, request_id: str) -> bool:
        return request_id in self._pending or request_id in self._done

    async def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The outcome, waiting up to ``timeout`` seconds; ``None`` if still running."""
        if request_id in self._done:
            return self._done[request_id]
        future, _ = self._pending[request_id]
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            return None

    @property
    def pending_count(self) -> int:
        return len(self._pending)
