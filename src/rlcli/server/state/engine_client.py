"""The HTTP process's end of the queue to the engine process (``engine/process.py``).

``EngineClient`` starts the engine, submits typed operations (``engine/ops.py``) and feeds the
replies into the ``FutureStore``. Invariant 2 (every request gets an answer), the HTTP side: if
the engine process dies, every pending and every later request fails at once with the reason
instead of waiting forever, and the server then exits (``http/app.py``) so that whatever
supervises it (``rlcli serve start`` run again, a container restart policy) brings up a fresh one.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
from typing import Any

from rlcli.server.engine import ops
from rlcli.server.engine.ops import CANCEL, PARTIAL, READY
from rlcli.server.state.futures import FutureStore

log = logging.getLogger("rlcli.server")


def _engine_main(*args) -> None:
    """The engine process's entry: the model's code (torch's training parts, transformers) is
    imported there only, so the HTTP process starts without it (~0.5 s of imports a start)."""
    from rlcli.server.engine.process import engine_main

    engine_main(*args)


class EngineUnavailable(RuntimeError):
    """The engine is loading or gone; the message says which."""


class EngineClient:
    def __init__(
        self,
        settings: dict[str, Any],
        futures: FutureStore,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        """``on_death(reason)`` is called (from a thread) once, if the engine dies."""
        ctx = mp.get_context("spawn")  # never fork a process that has threads and a loop
        self._requests = ctx.Queue()
        self._results = ctx.Queue()
        self._futures = futures
        self.on_death = on_death
        self.info: dict[str, Any] | None = None  # set once the model is loaded
        self.error: str | None = None  # set if the engine failed to start or died
        self.ready = threading.Event()
        self._stopping = False  # a stop we asked for is not a death
        self._process = ctx.Process(
            target=_engine_main,
            args=(settings, self._requests, self._results),
            name="rlcli-engine",
            daemon=True,
        )

    def start(self) -> None:
        self._process.start()
        threading.Thread(target=self._read_replies, name="engine-replies", daemon=True).start()

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.error is None and self._process.is_alive()

    def submit(self, op: ops.Op) -> str:
        """Queue ``op`` on the engine; returns the request id to poll.

        Raises ``EngineUnavailable`` if the engine is gone: nothing would ever answer."""
        if self.error is not None or not self._process.is_alive():
            raise EngineUnavailable(self.error or "the engine process is not running")
        request_id = self._futures.create(type(op))
        self._requests.put((request_id, op))
        return request_id

    def cancel(self, request_id: str) -> None:
        """The client of a sample request went away: the engine drops its rows at the next
        decode step (its future still gets one reply, a user error)."""
        if self.error is None and self._process.is_alive():
            self._requests.put((CANCEL, request_id))

    def _read_replies(self) -> None:
        while True:
            try:
                request_id, status, value = self._results.get(timeout=0.5)
            except queue.Empty:
                if self._stopping:
                    return
                if not self._process.is_alive():
                    self._died(f"the engine process exited (code {self._process.exitcode})")
                    return
                continue
            except (EOFError, OSError):
                self._died("the engine's reply queue broke")
                return
            if request_id == READY:
                if status == "ok":
                    self.info = value
                else:
                    self._died(f"the engine failed to start: {value}")
                    return
                self.ready.set()
                continue
            if status == PARTIAL:
                self._futures.partial(request_id, value)
                continue
            self._futures.resolve(request_id, status, value)

    def _died(self, reason: str) -> None:
        self.error = reason
        log.error("engine failed: %s; failing every pending request", reason)
        self.ready.set()
        self._futures.fail_all(f"{reason}; restart the server (`rlcli serve start`)")
        if self.on_death is not None:
            self.on_death(reason)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self._process.is_alive():
            self._requests.put(None)
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
