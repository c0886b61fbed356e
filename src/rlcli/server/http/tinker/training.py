"""Training routes: create and unload training clients (LoRA adapters), ``forward_backward``
(protobuf) and ``optim_step``. Each validates, records and queues a typed operation."""

from __future__ import annotations

import math
import uuid

from fastapi import APIRouter, HTTPException, Request

from rlcli.server import wire
from rlcli.server.engine import ops
from rlcli.server.http.tinker.schemas import (
    LORA_ALPHA_METADATA,
    MODEL_ROLE_METADATA,
    CreateModel,
    LoraConfig,
    ModelRef,
    OptimizerConfig,
    OptimStep,
)
from rlcli.server.http.tinker.validate import validate_forward_backward
from rlcli.server.state.sessions import ModelRecord, ServerState, State

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(body: CreateModel, state: State):
    info = state.engine_info()
    state.session(body.session_id)
    state.check_base_model(body.base_model)
    check_optimizer(body.optimizer_config)
    lora = with_alpha(body.lora_config or LoraConfig(), body.user_metadata)
    if lora.rank > info["max_lora_rank"]:
        raise HTTPException(
            400,
            f"lora_config.rank: {lora.rank} is outside 1..{info['max_lora_rank']} "
            "(raise it with `rlcli serve start --max-lora-rank N`)",
        )
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise HTTPException(400, "lora_config: train_mlp, train_attn and train_unembed are all off")
    model_id = str(uuid.uuid4())
    role = model_role(body)
    return new_training_client(
        state, model_id, body.session_id, lora, body.user_metadata, critic=role == "critic"
    )


def model_role(body: CreateModel) -> str:
    """The body's ``model_role``, or the user_metadata key the SDK's create call can carry."""
    meta = (body.user_metadata or {}).get(MODEL_ROLE_METADATA)
    if meta is None:
        return body.model_role
    if meta not in ("policy", "critic"):
        raise HTTPException(
            400, f"user_metadata.{MODEL_ROLE_METADATA}: {meta!r}; use 'policy' or 'critic'"
        )
    return meta


def with_alpha(lora: LoraConfig, user_metadata: dict | None) -> LoraConfig:
    """``lora`` with the alpha an rlcli client put in ``user_metadata``; 400 if it is no
    positive number."""
    raw = (user_metadata or {}).get(LORA_ALPHA_METADATA)
    if raw is None:
        return lora
    try:
        alpha = float(raw)
    except (TypeError, ValueError):
        alpha = math.nan
    if not (0 < alpha <= 1e6):
        raise HTTPException(
            400, f"user_metadata.{LORA_ALPHA_METADATA}: {raw!r} is not a number in (0, 1e6]"
        )
    return lora.model_copy(update={"alpha": alpha})


def check_optimizer(config: OptimizerConfig | None) -> None:
    if config is not None and config.type != "adamw":
        raise HTTPException(
            400,
            f"optimizer_config.type: {config.type!r} is not implemented on this server; "
            "use the default, AdamW (optimizer_config {'type': 'adamw'})",
        )


def new_training_client(
    state: ServerState,
    model_id: str,
    session_id: str,
    lora: LoraConfig,
    user_metadata: dict | None,
    then: ops.Op | None = None,
    payload: bytes = b"",
    critic: bool = False,
) -> dict:
    """Record a training client and queue the creation of its adapter (and ``then``, its
    first operation, whose future is answered instead: create via load). ``critic``: a
    value head on the adapter, trained with ppo_critic."""
    record = ModelRecord(
        model_id, session_id, state.settings.base_model, lora.model_dump(),
        dict(user_metadata or {}), critic=critic,
    )  # fmt: skip
    run = {
        "training_run_id": model_id,
        "base_model": record.base_model,
        "lora": record.lora,
        "session_id": session_id,
        "user_metadata": record.user_metadata,
        "created": record.created,
        "model_role": "critic" if critic else "policy",
    }
    future = state.submit(
        ops.CreateAdapter(
            model_id,
            lora.rank,
            lora.seed,
            lora.train_mlp,
            lora.train_attn,
            lora.train_unembed,
            alpha=lora.alpha,
            critic=critic,
            run_record=run,
            checkpoints_root=str(state.checkpoints_root),
        ),  # run.json is written by the engine once the adapter exists
        model_id,
    )
    state.models[model_id] = record
    if then is not None:
        future = state.submit_for(record, then, None, payload)
    return future


@router.post("/get_info")
async def get_info(body: ModelRef, state: State):
    record = state.model(body.model_id)
    return {
        "type": "get_info",
        "model_id": record.model_id,
        "model_data": {
            "arch": "lora",
            "model_name": record.base_model,
            # A local folder path is a tokenizer id AutoTokenizer loads offline.
            "tokenizer_id": record.base_model,
        },
        "is_lora": True,
        "lora_rank": record.lora.get("rank"),
        "model_name": record.base_model,
    }


@router.post("/unload_model")
async def unload_model(body: ModelRef, state: State):
    state.model(body.model_id)
    future = state.submit(ops.RemoveAdapter(body.model_id), body.model_id)
    del state.models[body.model_id]
    return future


@router.post("/forward_backward")
async def forward_backward(request: Request, state: State):
    info = state.engine_info()
    if wire.PROTO_CONTENT_TYPE not in request.headers.get("content-type", ""):
        raise HTTPException(
            415, f"forward_backward takes a {wire.PROTO_CONTENT_TYPE} body (tinker>=0.25)"
        )
    body = await request.body()
    body = wire.decompress(
        body, request.headers.get("content-encoding", ""), state.settings.max_body_bytes
    )
    req = wire.decode_forward_backward(body)
    record = state.model(req.model_id)
    validate_forward_backward(req, info["vocab_size"], info["max_context"], record.critic)
    op = ops.ForwardBackward(
        req.model_id, req.data, req.loss_fn, req.loss_fn_config, req.forward_only
    )
    return state.submit_for(record, op, req.seq_id, body)


@router.post("/optim_step")
async def optim_step(body: OptimStep, state: State):
    state.engine_info()
    record = state.model(body.model_id)
    op = ops.OptimStep(body.model_id, body.adam_params.model_dump())
    return state.submit_for(record, op, body.seq_id, body.model_dump_json().encode())
