"""Sampler weights: snapshots of adapters that sampling requests read from, one bounded LRU.

Invariant 4 lives here: a sampler key serves exactly the weights last saved under it. A key
is ``ephemeral:<id>`` (an unnamed ``save_weights_for_sampler``: memory only) or a checkpoint's
name on disk. Each key holds the LoRA config and a CPU copy of the weights, tagged with the
version folder they came from; at most ``max_live`` of them are also loaded as peft adapters
for sampling. ``put`` replaces a key's weights and drops its live adapter, and a key read from
disk is checked against the version its name points to now (re-saved or deleted elsewhere),
so no stale adapter is ever served.

A snapshot in use is never evicted: the bound is per training client, not shared. Each
client's newest ``per_client`` snapshots (its last steps: an RL loop samples from the step it
just saved, an async one from a few steps back) and any snapshot sampled since its client's
last save are kept whatever other clients do; only the rest (older steps, checkpoints read
from disk, snapshots of removed clients) share the LRU of ``max_snapshots``. Before, 17
clients saving at once pushed the first one's new snapshot out before it was used ("sampler
expired").
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.server.errors import UserError
from rlcli.server.store import checkpoints

EPHEMERAL = "ephemeral:"


@dataclass
class Snapshot:
    config: Any  # peft LoraConfig
    state: dict  # CPU tensors
    version: str | None  # the version folder it was read from or written to; None: ephemeral
    owner: str | None = None  # the training client that saved it (None: read from disk)
    step: int = 0  # its owner's save count when it was saved
    used_at: int = -1  # its owner's save count when it was last sampled from


class SamplerCache:
    def __init__(
        self,
        add_adapter: Callable[[str, Any, dict], None],
        delete_adapter: Callable[[str], None],
        max_snapshots: int = 16,
        max_live: int = 8,
        per_client: int = 2,
    ) -> None:
        self._add = add_adapter
        self._delete = delete_adapter
        self.max_snapshots = max_snapshots
        self.max_live = max_live
        self.per_client = per_client
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self.live: OrderedDict[str, str] = OrderedDict()  # key -> peft adapter name
        self.saves: dict[str, int] = {}  # training client -> how many snapshots it saved

    def put(
        self, key: str, config: Any, state: dict, version: str | None, owner: str | None = None
    ) -> None:
        """Store (or replace) the weights behind ``key``, saved by training client ``owner``.
        The owner's older snapshots stay stored but leave peft: an RL loop samples from the
        snapshot it just saved, and the engine refills the adapter they free for the next
        one (~70 ms on SmolLM2 at rank 32, where building one took 0.5-0.9 s)."""
        self._unload(key)
        self.snapshots.pop(key, None)
        step = 0
        if owner is not None:
            step = self.saves[owner] = self.saves.get(owner, 0) + 1
            for older in [k for k, snap in self.snapshots.items() if snap.owner == owner]:
                self._unload(older)
        self.snapshots[key] = Snapshot(config, state, version, owner, step)
        self._evict(keep=key)  # the snapshot just stored is about to be used

    def _kept(self, snap: Snapshot) -> bool:
        """In use: one of its client's newest ``per_client``, or sampled since its last save."""
        if snap.owner is None or snap.owner not in self.saves:
            return False
        last = self.saves[snap.owner]
        return snap.step > last - self.per_client or snap.used_at == last

    def _evict(self, keep: str | None = None) -> None:
        """Beyond ``max_snapshots``, drop the least recently used snapshots not in use (nor
        ``keep``: a checkpoint read from disk to be sampled now, however many are in use)."""
        spare = [
            k for k, snap in self.snapshots.items() if k != keep and not self._kept(snap)
        ]  # LRU first
        for key in spare[: max(0, len(self.snapshots) - self.max_snapshots)]:
            self.forget(key)

    def forget(self, key: str) -> None:
        self._unload(key)
        self.snapshots.pop(key, None)

    def drop_owner(self, owner: str) -> None:
        """Its training client is gone: its snapshots stay (sampling clients outlive training
        clients) but are no longer kept in use; the LRU bound applies to them again."""
        self.saves.pop(owner, None)
        self._evict()

    def activate(self, key: str) -> str:
        """The peft adapter name that samples from ``key``, loading it if needed."""
        current = self._current_version(key)
        snap = self.snapshots.get(key)
        if snap is not None and snap.version != current:
            self.forget(key)  # re-saved or deleted since it was cached
            snap = None
        if snap is None:
            if current is None:
                raise UserError(
                    "sampler expired: save the weights for sampling again"
                    if key.startswith(EPHEMERAL)
                    else "model_path: the checkpoint was deleted or expired"
                )
            config, state, _ = checkpoints.read_adapter(current, optimizer=False)
            self.put(key, config, state, current)
            snap = self.snapshots[key]
        self.snapshots.move_to_end(key)
        if snap.owner is not None:
            snap.used_at = self.saves.get(snap.owner, -1)
        if key in self.live:
            self.live.move_to_end(key)
            return self.live[key]
        while len(self.live) >= self.max_live:
            self._unload(next(iter(self.live)))
        name = f"sampler-{time.monotonic_ns()}"
        # peft keeps (and may change) the config it is given: hand it a copy.
        self._add(name, copy.deepcopy(snap.config), snap.state)
        self.live[key] = name
        return name

    def _current_version(self, key: str) -> str | None:
        if key.startswith(EPHEMERAL):
            snap = self.snapshots.get(key)
            return None if snap is None else snap.version
        version = checkpoints.resolve(Path(key))
        return None if version is None else str(version)

    def _unload(self, key: str) -> None:
        name = self.live.pop(key, None)
        if name is not None:
            self._delete(name)

    def live_count(self) -> int:
        return len(self.live)
