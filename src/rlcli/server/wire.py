"""Wire codecs: the protobuf bodies of the tinker client, to and from plain numpy.

The client sends ``forward_backward`` (and ``forward``) as ``tinker_public.ForwardBackwardRequest``
protobuf and asks for ``ForwardBackwardOutput`` and ``SampleResponse`` as protobuf (``Accept:
application/x-protobuf``). We reuse the generated classes shipped inside ``tinker`` (via
the installed SDK, 0.38) instead of redefining the schema: protobuf is additive, so the newest
schema reads every older client's bodies, and fields an older client never sets read as unset.
Everything past this module sees numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as public_pb  # the newest schema: a superset

from rlcli.server.errors import InvalidPayload

PROTO_CONTENT_TYPE = "application/x-protobuf"


class WireError(InvalidPayload):
    """A request body that cannot be decoded; the message names the field."""


@dataclass
class DatumArrays:
    tokens: np.ndarray  # int64 [N], the model input
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # loss_fn_inputs, each [N]
    # tinker>=0.38 provenance: the run lengths of model_input_spans / loss_fn_input_spans
    # (None: not sent). Only checked here: they must tile what they annotate.
    input_spans: list[int] | None = None
    target_spans: list[int] | None = None


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[DatumArrays]


MAX_ELEMENTS = 1 << 28  # per tensor: far beyond any real datum, well inside memory


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The body under its ``Content-Encoding`` (none or zstd), at most ``limit`` bytes."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise WireError(f"Content-Encoding: {encoding!r} is not supported (use zstd or none)")
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as e:
        raise WireError(f"body: not valid zstd data ({e})") from None
    if len(out) > limit:
        raise WireError(f"body: more than {limit} bytes once decompressed")
    return out


_DTYPES = {
    public_pb.DTYPE_FLOAT32: np.float32,
    public_pb.DTYPE_INT64: np.int64,
    public_pb.DTYPE_INT32: np.int32,
}


def _decode_tensor(msg, where: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}: unsupported dtype {msg.dtype}")
    shape = [int(d) for d in msg.shape]
    if any(d < 0 for d in shape) or len(shape) > 2 or math.prod(shape) > MAX_ELEMENTS:
        raise WireError(f"{where}: shape {shape} is not a 1-d or 2-d shape of a sane size")
    kind = msg.WhichOneof("encoding")
    if kind == "sparse_csr":
        if len(shape) != 2:
            raise WireError(f"{where}: a sparse tensor needs a 2-d shape, got {shape}")
        sparse = msg.sparse_csr
        for name, raw, size in (
            ("values", sparse.values, np.dtype(dtype).itemsize),
            ("crow_indices", sparse.crow_indices, 8),
            ("col_indices", sparse.col_indices, 8),
        ):
            if len(raw) % size:
                raise WireError(f"{where}.{name}: {len(raw)} bytes is not whole elements")
        values = np.frombuffer(sparse.values, dtype=dtype)
        crow = np.frombuffer(sparse.crow_indices, dtype=np.int64)
        col = np.frombuffer(sparse.col_indices, dtype=np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(values):
            raise WireError(f"{where}: inconsistent sparse CSR indices")
        if crow[0] != 0 or crow[-1] != len(values) or np.any(np.diff(crow) < 0):
            raise WireError(f"{where}: crow_indices must rise from 0 to the number of values")
        if col.size and (col.min() < 0 or col.max() >= shape[1]):
            raise WireError(f"{where}: a column index is outside 0..{shape[1] - 1}")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            start, end = crow[row], crow[row + 1]
            dense[row, col[start:end]] = values[start:end]
        return dense
    raw = msg.dense if kind == "dense" else b""
    if len(raw) % np.dtype(dtype).itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a whole number of elements")
    arr = np.frombuffer(raw, dtype=dtype)
    if shape:
        if math.prod(shape) != arr.size:
            raise WireError(f"{where}: shape {shape} does not match {arr.size} elements")
        arr = arr.reshape(shape)
    return arr


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    msg = public_pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf raises its own DecodeError
        raise WireError(f"body: not a ForwardBackwardRequest protobuf ({e})") from None
    data = []
    for i, datum in enumerate(msg.data):
        pieces = []
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(
                    f"data[{i}].model_input.chunks[{j}]: {kind or 'empty'} chunks are not "
                    "supported (text tokens only)"
                )
            pieces.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
        inputs = {
            name: _decode_tensor(tensor, f"data[{i}].loss_fn_inputs.{name}")
            for name, tensor in datum.loss_fn_inputs.items()
        }
        spans = [_span_lengths(datum.model_input_spans), _span_lengths(datum.loss_fn_input_spans)]
        if (spans[0] is None) != (spans[1] is None):
            raise WireError(
                f"data[{i}]: model_input_spans and loss_fn_input_spans come together or not at all"
            )
        data.append(DatumArrays(tokens, inputs, *spans))
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=_loss_config(msg),
        forward_only=msg.forward_only,
        data=data,
    )


def _span_lengths(spans) -> list[int] | None:
    if not spans:
        return None
    lengths = []
    for span in spans:
        kind = span.WhichOneof("span")
        lengths.append(int(getattr(span, kind).length) if kind else 0)
    return lengths


def _loss_config(msg) -> dict[str, float]:
    """``loss_fn_config_v2`` (tinker>=0.38; numbers or text) when set, else the legacy
    float map. Every loss served takes numbers: a text value is refused by name."""
    if not msg.loss_fn_config_v2:
        return {k: float(v) for k, v in msg.loss_fn_config.items()}
    config = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise WireError(f"loss_fn_config.{key}: a number is expected, got text")
        config[key] = float(value.number)
    return config


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """Batched ``ArrayRecord``s: per field, the datums' arrays concatenated with byte offsets.
    Datums whose arrays differ in trailing shape ([N] vs [N, K]) go in separate consecutive
    records, as the client's decoder expects."""
    msg = public_pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    start = 0
    while start < len(outputs):
        trailing = {k: v.shape[1:] for k, v in outputs[start].items()}
        end = start + 1
        while end < len(outputs) and {k: v.shape[1:] for k, v in outputs[end].items()} == trailing:
            end += 1
        _add_record(msg, outputs[start:end], trailing)
        start = end
    return msg.SerializeToString()


def _add_record(msg, outputs: list[dict[str, np.ndarray]], trailing: dict) -> None:
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(outputs)
    for name in outputs[0]:
        arrays = [np.ascontiguousarray(out[name], dtype=np.float32) for out in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = public_pb.DTYPE_FLOAT32
        bt.trailing_shape.extend(trailing[name])


def forward_backward_output_json(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> dict:
    """The JSON shape of the same result, for clients that do not ask for protobuf."""
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [
            {
                name: {
                    "data": arr.astype(float).ravel().tolist(),
                    "dtype": "float32",
                    "shape": list(arr.shape),
                }
                for name, arr in out.items()
            }
            for out in outputs
        ],
        "metrics": metrics,
    }


_STOP_REASONS = {"stop": public_pb.STOP_REASON_STOP, "length": public_pb.STOP_REASON_LENGTH}


def encode_sample_response(output) -> bytes:
    """A ``server.sampling.SampleOutput`` as the client's ``SampleResponse`` protobuf. The
    fields an older client does not know are only set when asked for."""
    msg = public_pb.SampleResponse()
    for i, (tokens, logprobs, reason) in enumerate(output.sequences):
        seq = msg.sequences.add()
        seq.stop_reason = _STOP_REASONS[reason]
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        if output.topk_sampled is not None:
            ids, lps = output.topk_sampled[i] or (np.zeros((0, 0), np.int32),) * 2
            _set_topk(seq.topk_sampled_logprobs, ids, lps)
    if output.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(output.prompt_logprobs, dtype=np.float32).tobytes()
    if output.topk_prompt is not None:
        _set_topk(msg.topk_prompt_logprobs, *output.topk_prompt)
    if output.target_prompt is not None:
        _set_tensor(msg.target_prompt_logprobs, output.target_prompt, output.target_layout)
    if output.prompt_alt is not None:
        _set_tensor(msg.prompt_alt_tokens.tokens, output.prompt_alt[0])
        _set_tensor(msg.prompt_alt_tokens.logprobs, output.prompt_alt[1])
    return msg.SerializeToString()


def _set_topk(msg, ids: np.ndarray, lps: np.ndarray) -> None:
    """``TopkLogprobs`` (0.25 called it ``TopkPromptLogprobs``; field 4 was ``prompt_length``)."""
    msg.token_ids = np.ascontiguousarray(ids, np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(lps, np.float32).tobytes()
    msg.k = ids.shape[1] if ids.ndim == 2 else 0
    msg.length = ids.shape[0]


_TENSOR_DTYPES = {np.dtype(np.float32): "DTYPE_FLOAT32", np.dtype(np.int32): "DTYPE_INT32"}


def _set_tensor(msg, array: np.ndarray, sparse: tuple[np.ndarray, np.ndarray] | None = None):
    """A dense tensor, or a sparse CSR one holding the cells of ``sparse`` (crow, col)."""
    msg.dtype = getattr(public_pb, _TENSOR_DTYPES[array.dtype])
    msg.shape.extend(array.shape)
    if sparse is None:
        msg.dense = np.ascontiguousarray(array).tobytes()
        return
    crow, col = sparse
    rows = np.repeat(np.arange(array.shape[0]), np.diff(crow))
    msg.sparse_csr.values = np.ascontiguousarray(array[rows, col]).tobytes()
    msg.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
    msg.sparse_csr.col_indices = np.asarray(col, np.int64).tobytes()


def sample_response_json(output) -> dict:
    def nan_to_none(values):
        return [None if np.isnan(v) else float(v) for v in values]

    def tensor(array: np.ndarray) -> dict:
        dtype = "float32" if array.dtype == np.float32 else "int64"
        return {"data": array.ravel().tolist(), "dtype": dtype, "shape": list(array.shape)}

    extra: dict = {}
    if output.target_prompt is not None:
        extra["target_prompt_logprobs"] = tensor(output.target_prompt)
    if output.prompt_alt is not None:
        tokens, logprobs = output.prompt_alt
        extra["prompt_alt_tokens"] = {"tokens": tensor(tokens), "logprobs": tensor(logprobs)}
    sequences = []
    for i, (t, lp, reason) in enumerate(output.sequences):
        seq = {"tokens": t.tolist(), "logprobs": lp.tolist(), "stop_reason": reason}
        if output.topk_sampled is not None and output.topk_sampled[i] is not None:
            ids, lps = output.topk_sampled[i]
            seq["topk_logprobs"] = [
                list(zip(r_ids.tolist(), r_lps.tolist(), strict=True))
                for r_ids, r_lps in zip(ids, lps, strict=True)
            ]
        sequences.append(seq)
    return extra | {
        "type": "sample",
        "sequences": sequences,
        "prompt_logprobs": None
        if output.prompt_logprobs is None
        else nan_to_none(output.prompt_logprobs),
    }
