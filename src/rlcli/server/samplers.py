"""Sampler weights: snapshots of adapters that sampling requests read from, one bounded LRU.

Invariant 4 lives here: a sampler key serves exactly the weights last saved under it. A key
is ``ephemeral:<id>`` (an unnamed ``save_weights_for_sampler``: memory only) or a checkpoint's
name on disk. Each key holds the LoRA config and a CPU copy of the weights, tagged with the
version folder they came from; at most ``max_live`` of them are also loaded as peft adapters
for sampling. ``put`` replaces a key's weights and drops its live adapter, and a key read from
disk is checked against the version its name points to now (re-saved or deleted elsewhere),
so no stale adapter is ever served.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.server import checkpoints
from rlcli.server.errors import UserError

EPHEMERAL = "ephemeral:"


@dataclass
class Snapshot:
    config: Any  # peft LoraConfig
    state: dict  # CPU tensors
    version: str | None  # the version folder it was read from or written to; None: ephemeral


class SamplerCache:
    def __init__(
        self,
        add_adapter: Callable[[str, Any, dict], None],
        delete_adapter: Callable[[str], None],
        max_snapshots: int = 16,
        max_live: int = 8,
    ) -> None:
        self._add = add_adapter
        self._delete = delete_adapter
        self.max_snapshots = max_snapshots
        self.max_live = max_live
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self.live: OrderedDict[str, str] = OrderedDict()  # key -> peft adapter name

    def put(self, key: str, config: Any, state: dict, version: str | None) -> None:
        """Store (or replace) the weights behind ``key``."""
        self._unload(key)
        self.snapshots.pop(key, None)
        self.snapshots[key] = Snapshot(config, state, version)
        while len(self.snapshots) > self.max_snapshots:
            self.forget(next(iter(self.snapshots)))

    def forget(self, key: str) -> None:
        self._unload(key)
        self.snapshots.pop(key, None)

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
