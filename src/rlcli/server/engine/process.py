"""The engine process: builds the ``Engine`` and answers the typed operations (``ops.py``) that
the HTTP process queues (``state/engine_client.py`` is the other end of the queue).

Operations run in arrival order, which is each tinker client's order; ``Sample`` operations
are decoded together, continuously batched (``batcher.py``).

Invariant 2 (every request gets an answer) is held here for the engine's part: every operation
read from the queue gets exactly one reply (its result, a user error or a server error). If this
process dies, ``EngineClient`` fails every pending and later request with the reason.
"""

from __future__ import annotations

import logging
import os
import queue
import time
import traceback
from collections import deque
from typing import Any

from rlcli.server.engine import allocator, ops
from rlcli.server.engine.batcher import Batcher
from rlcli.server.engine.core import Engine
from rlcli.server.engine.ops import CANCEL, PARTIAL, READY
from rlcli.server.errors import UserError

log = logging.getLogger("rlcli.server")

# A sample request that starts a batch waits for others while they keep coming: until none
# arrived for GATHER_IDLE_S, at most GATHER_MAX_S in all. Concurrent clients (an eval's 64
# tasks, a step's rollouts) reach the queue spread over tens of ms; one prefill for them all is
# cheaper than one join each (later ones still join the running batch, see batcher.py).
GATHER_IDLE_S = 0.02
GATHER_MAX_S = 0.25


def engine_main(settings: dict[str, Any], requests, results) -> None:
    """Process entry point: build the engine, then serve ``(request_id, op)`` until told to
    stop (``None``) or the HTTP process disappears.

    Replies are ``(request_id, "ok", value)`` or ``(request_id, "user"|"server", message)``;
    the first is ``(READY, "ok", info)`` or ``(READY, "server", why)``.
    """
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    torch.set_num_threads(settings.get("threads") or torch.get_num_threads())
    allocator.keep_freed_memory()  # before the model loads: its blocks too
    try:
        engine = Engine(
            settings["base_model"],
            device=settings.get("device", "auto"),
            dtype=settings.get("dtype", "auto"),
            grad_checkpointing=settings.get("grad_checkpointing"),
            microbatch_tokens=settings.get("microbatch_tokens"),
            max_lora_rank=settings.get("max_lora_rank", 64),
            compile=settings.get("compile"),
        )
    except Exception as e:
        log.error("engine failed to start:\n%s", traceback.format_exc())
        results.put((READY, "server", f"{type(e).__name__}: {e}"))
        return
    results.put((READY, "ok", engine.info()))
    log.info("engine ready: %s", engine.info())
    serve(engine, requests, results, os.getppid())


def serve(
    engine, requests, results, parent: int | None = None, join: bool = True, batcher=None
) -> None:
    """Run operations in arrival order until a stop (``None``) or the parent process is gone.

    Sample operations go to the ``Batcher``: one decode step at a time, with new requests
    joining the running batch between steps; a streaming request's tokens are sent as they are
    drawn, before its reply, and a cancel takes a request's rows out before the next step.
    Any other operation waits until the samples that arrived before it are answered, and
    samples that arrive after it wait for it, so order across kinds holds (a sampler saved
    after a step samples the new weights). ``join=False`` decodes each batch to the end first
    (the old behaviour, for benchmarks).
    """

    batcher = batcher or Batcher(engine, join=join)  # a benchmark may pass one to watch
    pending: deque = deque()  # read from the queue, not yet run, in order
    graphs = 0
    while True:
        if getattr(engine, "compiled_graphs", None) and engine.compiled_graphs() != graphs:
            graphs = engine.compiled_graphs()  # new compile times for /rlcli/status
            results.put((READY, "ok", engine.info()))
        if not pending and not batcher.busy:
            item = _next(requests, parent)
            if item is None:  # stop, or the HTTP process is gone
                return
            pending.append(item)
            if _is_sample(item):
                _gather(requests, pending)
        else:
            _drain(requests, pending)
            if parent is not None and os.getppid() != parent:
                return
        _cancel(pending, batcher, results)
        samples = []
        while pending and _is_sample(pending[0]):
            samples.append(pending.popleft())
        if samples:
            _send(results, batcher.add([(rid, op.job) for rid, op in samples]), batcher)
        if pending:  # a stop or another kind is next: the samples before it finish first
            while batcher.busy:
                _send(results, batcher.step(), batcher)
                _drain(requests, pending)  # a stream's client may leave meanwhile
                _cancel(pending, batcher, results)
            item = pending.popleft()
            if item is None:
                return
            _run_one(engine, item, results)
        elif batcher.busy:
            _send(results, batcher.step(), batcher)


def _is_sample(item) -> bool:
    return item is not None and isinstance(item[1], ops.Sample)


def _cancel(pending: deque, batcher, results) -> None:
    """Apply the cancels read so far: a request not started is answered at once, a decoding
    one leaves the batch; each answer is the one reply its future gets."""

    cancels = [item[1] for item in pending if item is not None and item[0] == CANCEL]
    if not cancels:
        return
    for item in [item for item in pending if item is not None and item[0] == CANCEL]:
        pending.remove(item)
    for request_id in cancels:
        reply = UserError("cancelled: the client went away")
        queued = [item for item in pending if item is not None and item[0] == request_id]
        if queued:
            pending.remove(queued[0])
            _reply(results, request_id, reply)
        else:
            _send(results, batcher.cancel(request_id, reply))


def _gather(requests, pending: deque) -> None:
    """Before a new batch starts, wait for more sample requests while they keep coming (until
    none for GATHER_IDLE_S, at most GATHER_MAX_S): one prefill for the lot is cheaper than a
    join per request. Stops at the first request of another kind."""
    deadline = time.monotonic() + GATHER_MAX_S
    while len(pending) < 64:
        wait = min(GATHER_IDLE_S, deadline - time.monotonic())
        try:
            item = requests.get(timeout=max(0.0, wait))
        except queue.Empty:
            return
        pending.append(item)
        if not _is_sample(item):
            return


def _drain(requests, pending: deque) -> None:
    """Read what has already arrived, without waiting."""
    while True:
        try:
            pending.append(requests.get_nowait())
        except queue.Empty:
            return


def _send(results, replies, batcher=None) -> None:
    """The replies of an add or a step, after the streamed tokens drawn in it."""
    if batcher is not None:
        for request_id, tokens in batcher.take_partials():
            results.put((request_id, PARTIAL, tokens))
    for request_id, outcome in replies:
        _reply(results, request_id, outcome)


def _next(requests, parent: int | None):
    while True:
        try:
            return requests.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and os.getppid() != parent:  # the HTTP process died
                return None


def _reply(results, request_id: str, outcome: Any) -> None:

    if isinstance(outcome, UserError):
        results.put((request_id, "user", str(outcome)))
    elif isinstance(outcome, Exception):
        results.put((request_id, "server", f"{type(outcome).__name__}: {outcome}"))
    else:
        results.put((request_id, "ok", outcome))


def _run_one(engine, item, results) -> None:
    request_id, op = item
    started = time.perf_counter()
    try:
        outcome = op.run(engine)
    except Exception as e:
        if not isinstance(e, UserError):
            log.error("%s failed:\n%s", type(op).__name__, traceback.format_exc())
        outcome = e
    _reply(results, request_id, outcome)
    log.debug("%s %s took %.3fs", type(op).__name__, request_id, time.perf_counter() - started)
