"""Continuous batching of sample requests on the engine (the engine process's scheduler).

A request that arrives while others decode is prefilled and joins the running batch at the next
decode step; finished rows leave it, so a late request never waits for a whole second decode.
One batch runs at a time. On our decode step (``slot_batch.SlotBatch``) its rows may belong to
any samplers (the base model, several clients' adapter snapshots); on transformers' forward
(other architectures) to one, and requests for another sampler wait until it empties.
``Engine.sample`` is the simpler version: a fixed set of requests decoded to the end (what a
failed batch falls back to, to find the culprit).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from rlcli.server.engine.sample_requests import SAMPLE_ROWS_PER_BATCH
from rlcli.server.engine.sampling import DecodeBatch, SampleJob

log = logging.getLogger("rlcli.engine")

Reply = tuple[Any, Any]  # (request id, SampleOutput or the exception that is its answer)


class Batcher:
    def __init__(self, engine, max_rows: int = SAMPLE_ROWS_PER_BATCH, join: bool = True) -> None:
        """``join=False``: new requests wait for the running batch to end (the behaviour before
        continuous batching; benchmarks compare against it)."""
        self.engine = engine
        self.max_rows = max_rows
        self.join = join
        self.batch: DecodeBatch | None = None
        self.key: str | None = None  # the running batch's sampler
        self.waiting: deque[tuple[Any, SampleJob]] = deque()
        # Counters (for logs and tests): decode passes run, requests that joined a batch
        # already decoding, batches started.
        self.stats = {"decode_steps": 0, "joined": 0, "batches": 0}

    @property
    def busy(self) -> bool:
        """Requests taken and not yet answered (the engine must run nothing else meanwhile)."""
        return bool(self.waiting) or bool(self.batch is not None and len(self.batch))

    def add(self, items: list[tuple[Any, SampleJob]]) -> list[Reply]:
        """Take ``(request_id, job)`` requests; those that can join the running batch do now."""
        for request_id, job in items:
            self.waiting.append((request_id, self.engine.add_stops(job)))
        return self._admit()

    def step(self) -> list[Reply]:
        """One decode step of the running batch (starting the next one if it is empty)."""
        replies = self._admit()
        if self.batch is None or not len(self.batch):
            return replies
        try:
            replies.extend(self.batch.step())
            self.stats["decode_steps"] += 1
        except Exception:
            log.exception("a decode step failed; sampling its requests again one by one")
            replies.extend(self._retry_alone())
        if self.batch is not None and not len(self.batch):
            log.info("sampling batch done: %s", self.stats)
        return replies

    def cancel(self, request_id: Any, reply: Exception) -> list[Reply]:
        """Forget a request whose client went away: out of the queue, or its rows out of the
        running batch (before the next step). Its one answer is ``reply``; nothing if it was
        already answered."""
        for item in self.waiting:
            if item[0] == request_id:
                self.waiting.remove(item)
                return [(request_id, reply)]
        if self.batch is not None and self.batch.cancel(request_id):
            if not len(self.batch):
                log.info("sampling batch done: %s", self.stats)
            return [(request_id, reply)]
        return []

    def take_partials(self) -> list[tuple[Any, list[tuple]]]:
        """The streaming requests' tokens drawn since the last call, per request id."""
        if self.batch is None or not self.batch.partials:
            return []
        taken = list(self.batch.partials.items())
        self.batch.partials.clear()
        return taken

    def _admit(self) -> list[Reply]:
        replies: list[Reply] = []
        while self.waiting and (self.batch is None or not len(self.batch)):
            self.key = self.waiting[0][1].sampler
            try:
                self.batch = self.engine.decode_batch(self.key)
            except Exception as e:  # e.g. an expired sampler: its requests get the reason
                self.batch = None
                replies.extend((rid, e) for rid, job in self.waiting if job.sampler == self.key)
                self.waiting = deque(w for w in self.waiting if w[1].sampler != self.key)
                continue
            self.stats["batches"] += 1
            replies.extend(self._prefill(self._take()))
        running = self.batch is not None and len(self.batch)
        if self.waiting and running and self.join and self.batch.can_join:
            taken = self._take()
            self.stats["joined"] += len(taken)
            replies.extend(self._prefill(taken))
        return replies

    def _take(self) -> list[tuple[Any, SampleJob]]:
        """Waiting requests the running batch accepts (its sampler, or any its decode step can
        apply), in order, while rows stay within ``max_rows`` (a bigger request runs alone)."""
        rows = len(self.batch)
        taken, left = [], deque()
        for item in self.waiting:
            n = item[1].num_samples
            fits = rows + n <= self.max_rows or not rows
            if fits and self.batch.accepts(item[1].sampler):
                taken.append(item)
                rows += n
            else:
                left.append(item)
        self.waiting = left
        return taken

    def _prefill(self, items: list[tuple[Any, SampleJob]]) -> list[Reply]:
        if not items:
            return []
        try:
            return self.batch.admit([job for _, job in items], [rid for rid, _ in items])
        except Exception as e:
            if len(items) == 1:
                log.exception("sampling failed")
                return [(items[0][0], e)]
        replies = []
        for item in items:  # isolate the culprit: the others still join
            replies.extend(self._prefill([item]))
        return replies

    def _retry_alone(self) -> list[Reply]:
        """The batch failed mid-decode: run each of its unanswered requests from scratch, alone
        (a seeded request gives the same tokens), so only a culprit fails."""
        entries = {id(row.job): row.job for row in self.batch.rows}.values()
        self.batch = None
        replies = []
        for entry in entries:
            (out,) = self.engine.sample([entry.job])
            replies.append((entry.ticket, out))
        return replies
