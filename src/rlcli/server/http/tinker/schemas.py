"""Request bodies, typed at the boundary: no handler ever sees an unchecked value.

One pydantic model per JSON body of the tinker client, for every SDK generation served (0.25 to
0.38: the union of their request types, read from ``tinker/types`` of each; a field only the
newer generation sends is optional here). Strict types (``"abc"`` is not a number, ``1.5`` is
not a count), no NaN or infinity, bounded integers; fields the client may add later are
ignored. A body that fails answers 422 naming the field (``http/app.py``; 400 under
``/v1``). ``forward_backward`` is protobuf (``wire.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Every integer on the wire fits in an int64; seeds are uint64 in the protobuf schema.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Seed = Annotated[int, Field(ge=0, le=2**64 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class Body(BaseModel):
    model_config = ConfigDict(
        strict=True, allow_inf_nan=False, extra="ignore", protected_namespaces=()
    )


class CreateSession(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    display_name: str | None = None


class FinishReason(Body):
    type: Literal["success", "errored", "interrupted"]


class FinishSession(Body):
    """``POST /sessions/{id}/finish`` (tinker>=0.38 ``ServiceClient.close``)."""

    reason: FinishReason
    detail: str | None = None


class OptimizerConfig(Body):
    """tinker>=0.38 names the optimizer at creation; only ``adamw`` is implemented here."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str = "adamw"


class SessionRef(Body):
    session_id: str


# The Tinker API's LoraConfig has a rank and no alpha; rlcli's clients (`train --lora-alpha`)
# send one in the create request's user_metadata under this key, as text.
LORA_ALPHA_METADATA = "rlcli_lora_alpha"


class LoraConfig(Body):
    rank: Annotated[int, Field(ge=1, le=2**20)] = 32
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True
    # rlcli's own: from user_metadata (LORA_ALPHA_METADATA), kept in run.json so a restored
    # training client scales as the saved one did; None: the engine's LORA_ALPHA
    alpha: Annotated[float, Field(gt=0, le=1e6)] | None = None


# A critic training client (a value head on the LoRA model, trained with ppo_critic): SkyRL's
# create_model body field, or, since the SDK's create call cannot add one, this
# user_metadata key (text "critic").
ModelRole = Literal["policy", "critic"]
MODEL_ROLE_METADATA = "model_role"


class CreateModel(Body):
    session_id: str
    base_model: str
    model_seq_id: Int64 | None = None
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None
    model_role: ModelRole = "policy"


class ModelRef(Body):
    model_id: str


class AdamParams(Body):
    """Tinker's ``AdamParams`` and defaults; ranges where AdamW is defined."""

    learning_rate: Annotated[float, Field(ge=0)] = 1e-4
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: Annotated[float, Field(gt=0)] = 1e-12
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    grad_clip_norm: Annotated[float, Field(ge=0)] = 0.0


class OptimStep(Body):
    model_id: str
    adam_params: AdamParams = AdamParams()
    seq_id: Int64 | None = None


TtlSeconds = Annotated[int, Field(ge=1, le=100 * 365 * 86400)]


class SaveWeights(Body):
    model_id: str
    path: str | None = None
    ttl_seconds: TtlSeconds | None = None
    seq_id: Int64 | None = None
    # tinker>=0.38: an "inflight" sampler may be served as a snapshot (the weights of now).
    kind: Literal["snapshot", "inflight"] = "snapshot"
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternal(Body):
    """tinker>=0.38: the adapter as files to download (``tinker checkpoint download``)."""

    model_id: str
    path: str
    seq_id: Int64 | None = None
    ttl_seconds: TtlSeconds | None = None
    age_encryption_recipients: list[str] | None = None


class LoadWeights(Body):
    """Either a load into an existing training client (``model_id`` + ``seq_id``, every SDK)
    or, from tinker 0.38, "create via load": ``session_id`` + ``model_seq_id`` make a new
    training client from the checkpoint (its LoRA config) named ``<session>:train:<seq>``."""

    model_id: str | None = None
    path: str
    optimizer: bool = False
    seq_id: Int64 | None = None
    session_id: str | None = None
    model_seq_id: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None


class WeightsInfo(Body):
    tinker_path: str


class CreateSamplingSession(Body):
    session_id: str
    base_model: str | None = None
    model_path: str | None = None


class TextChunk(Body):
    type: str = "encoded_text"
    tokens: list[TokenId]


class ModelInput(Body):
    chunks: list[TextChunk]


class TensorData(Body):
    """The JSON tensor of the SDK (``TensorData``), dense or sparse CSR."""

    data: list[Int64] | list[float]
    dtype: str
    shape: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = None
    sparse_crow_indices: list[Int64] | None = None
    sparse_col_indices: list[Int64] | None = None


class SamplingParams(Body):
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | list[TokenId] | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] = -1
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0


class Sample(Body):
    prompt: ModelInput
    sampling_params: SamplingParams = SamplingParams()
    num_samples: Annotated[int, Field(ge=1, le=128)] = 1
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: Int64 | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Annotated[int, Field(ge=0, le=1024)] = 0
    # tinker>=0.38
    topk_sample_logprobs: Annotated[int, Field(ge=0, le=1024)] = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: Annotated[int, Field(ge=0, le=1024)] = 0
    prompt_logprobs_last_n: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    record_stability_info: bool | None = None


class RetrieveFuture(Body):
    request_id: str
    allow_metadata_only: bool = False


class SetTtl(Body):
    ttl_seconds: TtlSeconds | None = None


def first_error(errors: list[dict]) -> str:
    """``field.path: message`` for the first pydantic error (``body`` dropped from the path)."""
    if not errors:
        return "body: invalid"
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    where = ".".join(loc) or "body"
    if error.get("type") == "json_invalid":
        return "body: not valid JSON"
    value = error.get("input")
    shown = f" (got {value!r:.60})" if loc and not isinstance(value, dict | list) else ""
    return f"{where}: {error.get('msg', 'invalid')}{shown}"
