"""The HTTP side's handle on the engine process: start it, send it work, collect replies."""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from typing import Any

from rlcli.server.engine import engine_main
from rlcli.server.futures import FutureStore

log = logging.getLogger("rlcli.server")


class EngineClient:
    def __init__(self, settings: dict[str, Any], futures: FutureStore) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that has threads and a loop
        self._requests = ctx.Queue()
        self._results = ctx.Queue()
        self._futures = futures
        self.info: dict[str, Any] | None = None  # set once the model is loaded
        self.error: str | None = None  # set if the engine failed to start or died
        self.ready = threading.Event()
        self._process = ctx.Process(
            target=engine_main,
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

    def submit(self, kind: str, op: str, /, **kwargs: Any) -> str:
        """Queue ``op`` on the engine; returns the request id to poll."""
        request_id = self._futures.create(kind)
        self._requests.put((request_id, op, kwargs))
        return request_id

    def _read_replies(self) -> None:
        while True:
            try:
                request_id, status, value = self._results.get(timeout=1.0)
            except Exception:  # queue.Empty: check the engine is still there
                if not self._process.is_alive():
                    self.error = self.error or (
                        f"engine process exited (code {self._process.exitcode})"
                    )
                    log.error(self.error)
                    self.ready.set()
                    self._futures.fail_all(self.error)
                    return
                continue
            if request_id == "__ready__":
                if status == "ok":
                    self.info = value
                else:
                    self.error = f"engine failed to start: {value}"
                    log.error(self.error)
                self.ready.set()
                continue
            self._futures.resolve(request_id, status, value)

    def stop(self, timeout: float = 5.0) -> None:
        if self._process.is_alive():
            self._requests.put(None)
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
