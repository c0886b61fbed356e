"""Futures: the tinker pattern of "POST returns a request id, poll ``retrieve_future``".

The HTTP process owns a ``FutureStore``; the engine's replies arrive from a reader thread and
are handed to the event loop (``call_soon_threadsafe``), the only thread that touches the
store. ``wait`` long-polls, so an idle client makes one request per poll window instead of
spinning, and a finished result is answered the moment it lands. A finished outcome is kept
for ``keep_s`` seconds, so a client may poll again after a dropped response. Only outcomes
already fetched count toward ``keep_done``: under load (clients pipelining hundreds of small
steps a second) a count limit on every outcome dropped a result its slower client had not
fetched yet, which it then asked for and got 404 ("every request gets an answer"). Outcomes
never fetched are bounded by ``keep_s`` and, against a client that never asks, ``keep_unfetched``.
A streaming request also has a listener: an ``asyncio.Queue`` that gets the engine's partial
results as they arrive, then the ``Outcome``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    status: str  # "ok" | "user" | "server"
    value: Any  # the engine's return value, or an error message
    op: type  # the ops.Op subclass asked for: its ``answer`` encodes the value
    finished: float = field(default_factory=time.monotonic)


class FutureStore:
    def __init__(
        self, keep_done: int = 4096, keep_s: float = 600.0, keep_unfetched: int = 65536
    ) -> None:
        self._pending: dict[str, tuple[asyncio.Future, type]] = {}
        self._listeners: dict[str, asyncio.Queue] = {}
        self._done: OrderedDict[str, Outcome] = OrderedDict()  # finished, not fetched yet
        self._fetched: OrderedDict[str, Outcome] = OrderedDict()  # finished and fetched
        self._keep_done = keep_done
        self._keep_s = keep_s
        self._keep_unfetched = keep_unfetched
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def create(self, op: type) -> str:
        request_id = str(uuid.uuid4())
        assert self._loop is not None, "FutureStore.bind() first"
        self._pending[request_id] = (self._loop.create_future(), op)
        return request_id

    def listen(self, request_id: str, queue: asyncio.Queue) -> None:
        """Put the request's partial results on ``queue`` as they arrive, then its ``Outcome``,
        each as ``(request_id, item)`` (event loop only; call right after ``create``: no reply
        can be handed over before the loop runs again)."""
        self._listeners[request_id] = queue

    def partial(self, request_id: str, value: Any) -> None:
        """Thread-safe: a partial result (a stream's new tokens) from the engine reader."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._partial, request_id, value)

    def _partial(self, request_id: str, value: Any) -> None:
        queue = self._listeners.get(request_id)
        if queue is not None:
            queue.put_nowait((request_id, value))

    def resolve(self, request_id: str, status: str, value: Any) -> None:
        """Thread-safe: called from the engine reader thread."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._resolve, request_id, status, value)

    def _resolve(self, request_id: str, status: str, value: Any) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        future, op = entry
        outcome = Outcome(status, value, op)
        queue = self._listeners.pop(request_id, None)
        if queue is not None:
            queue.put_nowait((request_id, outcome))
        self._done[request_id] = outcome
        self._prune()
        if not future.done():
            future.set_result(outcome)

    def _prune(self) -> None:
        cutoff = time.monotonic() - self._keep_s
        for kept, most in ((self._done, self._keep_unfetched), (self._fetched, self._keep_done)):
            while kept and (len(kept) > most or next(iter(kept.values())).finished < cutoff):
                kept.popitem(last=False)

    def fail_all(self, message: str) -> None:
        """Thread-safe: the engine died, every pending request fails with a server error."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._fail_all, message)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._pending):
            self._resolve(request_id, "server", message)

    def on_done(self, request_id: str, callback) -> None:
        """Call ``callback(outcome)`` once the request is answered, without fetching it (a
        client's ``retrieve_future`` still gets it); on the event loop."""
        entry = self._pending.get(request_id)
        if entry is not None:
            entry[0].add_done_callback(lambda future: callback(future.result()))
        elif request_id in self._done:
            callback(self._done[request_id])

    def known(self, request_id: str) -> bool:
        return any(request_id in d for d in (self._pending, self._done, self._fetched))

    async def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The outcome, waiting up to ``timeout`` seconds; ``None`` if still running;
        KeyError if the request is not known (never made, or its outcome has expired)."""
        entry = self._pending.get(request_id)
        if entry is not None:
            try:
                await asyncio.wait_for(asyncio.shield(entry[0]), timeout)
            except TimeoutError:
                return None
        outcome = self._done.pop(request_id, None)
        if outcome is None:
            return self._fetched[request_id]
        self._fetched[request_id] = outcome
        self._prune()
        return outcome

    @property
    def pending_count(self) -> int:
        return len(self._pending)
