"""The engine operations of hosted hypernetworks (``d2l.py``), typed as ``ops.py``'s are.

Kept apart from ``ops.py`` so the doc-to-LoRA feature is one room; the HTTP process imports
this module (no torch), the engine runs ``run``. Every answer is the engine's dict as is: the
routes (``http/d2l.py``) wait for it and return it, no Tinker future is involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlcli.server.engine.ops import Op

if TYPE_CHECKING:
    from rlcli.server.engine.core import Engine


@dataclass
class CreateHypernet(Op):
    hypernet_id: str
    settings: dict[str, Any]
    seed: int | None

    def run(self, engine: Engine) -> Any:
        return engine.hypernets.create(self.hypernet_id, self.settings, self.seed)


@dataclass
class RemoveHypernet(Op):
    hypernet_id: str

    def run(self, engine: Engine) -> Any:
        return engine.hypernets.remove(self.hypernet_id)


@dataclass
class HypernetStep(Op):
    hypernet_id: str
    examples: list[dict]
    lr: float
    l1: float
    train: bool

    def run(self, engine: Engine) -> Any:
        return engine.hypernets.step(self.hypernet_id, self.examples, self.lr, self.l1, self.train)


@dataclass
class SaveHypernet(Op):
    hypernet_id: str
    directory: str
    meta: dict[str, Any]

    def run(self, engine: Engine) -> Any:
        return engine.hypernets.save(self.hypernet_id, self.directory, self.meta)


@dataclass
class LoadHypernet(Op):
    hypernet_id: str
    directory: str
    path: str
    optimizer: bool

    def run(self, engine: Engine) -> Any:
        return engine.hypernets.load(self.hypernet_id, self.directory, self.path, self.optimizer)


@dataclass
class Internalize(Op):
    hypernet_id: str | None  # a training hypernetwork, or
    directory: str | None  # a hypernetwork checkpoint
    path: str
    document: str
    target: str  # the sampler checkpoint to write
    meta: dict[str, Any] = field(default_factory=dict)

    def run(self, engine: Engine) -> Any:
        return engine.hypernets.internalize(
            self.hypernet_id, self.directory, self.path, self.document, self.target, self.meta
        )
