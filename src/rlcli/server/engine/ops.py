"""The closed set of operations the HTTP process sends the engine, and how each is answered.

Each operation is a small typed record: ``run`` calls the engine (in the engine process),
``answer`` turns the engine's return value into the response body ``retrieve_future`` sends
(in the HTTP process). The queue between the two carries only these records (``process.py``,
``state/engine_client.py``), so there is no op name string to mistype and no if-chain to
extend. This module imports no torch: the HTTP process never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi.responses import Response

from rlcli.server import wire
from rlcli.server.store import checkpoints

if TYPE_CHECKING:
    from rlcli.server.engine.core import Engine
    from rlcli.server.engine.sample_job import SampleJob

# The queue's control words besides the ops (both processes read them from here).
READY = "__ready__"  # (READY, info) on the reply queue: the model is loaded
CANCEL = "__cancel__"  # (CANCEL, request_id) on the request queue: the client went away
PARTIAL = "partial"  # (request_id, PARTIAL, tokens) on the reply queue: a stream's new tokens


@dataclass
class Op:
    # Most answers are a Tinker response ``{"type": reply_type}`` plus some of the engine's
    # return value (``reply_keys``); an op without a reply_type answers the value itself.
    reply_type: ClassVar[str | None] = None
    reply_keys: ClassVar[tuple[str, ...]] = ()

    def run(self, engine: Engine) -> Any:
        raise NotImplementedError

    @classmethod
    def answer(cls, value: Any, accept_proto: bool) -> Any:
        if cls.reply_type is None:
            return value
        return {"type": cls.reply_type, **{key: value[key] for key in cls.reply_keys}}


@dataclass
class CreateAdapter(Op):
    reply_type, reply_keys = "create_model", ("model_id",)
    name: str
    rank: int
    seed: int | None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float | None = None  # None: the engine's LORA_ALPHA
    critic: bool = False  # a value head on the adapter (model_role "critic")
    run_record: dict[str, Any] | None = None  # the run's run.json, written once it exists
    checkpoints_root: str = ""

    def run(self, engine: Engine) -> Any:
        out = engine.create_adapter(
            self.name, self.rank, self.seed, self.train_mlp, self.train_attn, self.train_unembed,
            alpha=self.alpha, critic=self.critic,
        )  # fmt: skip
        if self.run_record is not None:  # after the adapter: a failure leaves no orphan run
            try:
                checkpoints.write_run(Path(self.checkpoints_root), self.name, self.run_record)
            except BaseException:
                engine.remove_adapter(self.name)
                raise
        return out


@dataclass
class RemoveAdapter(Op):
    reply_type, reply_keys = "unload_model", ("model_id",)
    name: str

    def run(self, engine: Engine) -> Any:
        return engine.remove_adapter(self.name)


@dataclass
class ForwardBackward(Op):
    model_id: str
    data: list[wire.DatumArrays]
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool

    def run(self, engine: Engine) -> Any:
        return engine.forward_backward(
            self.model_id, self.data, self.loss_fn, self.loss_fn_config, self.forward_only
        )

    @staticmethod
    def answer(value: Any, accept_proto: bool) -> Any:
        outputs, metrics = value
        if accept_proto:
            body = wire.encode_forward_backward_output(outputs, metrics)
            return Response(body, media_type=wire.PROTO_CONTENT_TYPE)
        return wire.forward_backward_output_json(outputs, metrics)


@dataclass
class OptimStep(Op):
    model_id: str
    adam: dict[str, float]

    def run(self, engine: Engine) -> Any:
        return engine.optim_step(self.model_id, **self.adam)

    @staticmethod
    def answer(value: Any, accept_proto: bool) -> Any:
        return {"metrics": value}


@dataclass
class SaveState(Op):
    reply_type, reply_keys = "save_weights", ("path",)
    model_id: str
    directory: str
    meta: dict[str, Any]

    def run(self, engine: Engine) -> Any:
        return engine.save_state(self.model_id, self.directory, self.meta)


@dataclass
class SaveExternal(SaveState):
    """tinker>=0.38 ``save_weights_external``: the adapter alone, as files to download."""

    reply_type, reply_keys = "save_weights_external", ("path", "size_bytes")

    def run(self, engine: Engine) -> Any:
        return engine.save_state(self.model_id, self.directory, self.meta, with_optimizer=False)


@dataclass
class LoadState(Op):
    reply_type, reply_keys = "load_weights", ("path", "model_id")
    model_id: str
    directory: str
    optimizer: bool
    path: str

    def run(self, engine: Engine) -> Any:
        return engine.load_state(self.model_id, self.directory, self.optimizer, self.path)


@dataclass
class SnapshotSampler(Op):
    """Freeze the adapter's weights under sampler ``key``; saved to ``directory`` if named."""

    model_id: str
    key: str
    directory: str | None
    meta: dict[str, Any] = field(default_factory=dict)

    def run(self, engine: Engine) -> Any:
        return engine.snapshot_sampler(self.model_id, self.key, self.directory, self.meta)

    @staticmethod
    def answer(value: Any, accept_proto: bool) -> Any:
        if value["path"]:
            return {"type": "save_weights_for_sampler", "path": value["path"]}
        session_id = value["key"].removeprefix("ephemeral:")  # unnamed: a sampling session
        return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": session_id}


@dataclass
class ForgetSampler(Op):
    """A checkpoint was deleted: drop its cached sampler weights."""

    key: str

    def run(self, engine: Engine) -> Any:
        engine.samplers.forget(self.key)
        return {}


@dataclass
class Sample(Op):
    """One ``asample`` request. The engine batches consecutive ones (``process.py``)."""

    job: SampleJob

    def run(self, engine: Engine) -> Any:
        (out,) = engine.sample([self.job])
        if isinstance(out, Exception):
            raise out
        return out

    @staticmethod
    def answer(value: Any, accept_proto: bool) -> Any:
        if accept_proto:
            return Response(wire.encode_sample_response(value), media_type=wire.PROTO_CONTENT_TYPE)
        return wire.sample_response_json(value)
