"""Our codecs against the tinker SDK's own converters: what the client sends we decode
exactly, and what we encode the client parses."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from rlcli.server import wire


def test_decode_what_the_sdk_sends_including_sparse_weights():
    weights = np.zeros((1, 6), dtype=np.float32)
    weights[0, 4:] = 1.0
    datum = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[1, 2, 3]),
                types.EncodedTextChunk(tokens=[4, 5, 6]),
            ]
        ),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array([2, 3, 4, 5, 6, 7])),
            "weights": types.TensorData.from_numpy(weights[0]),
            "advantages": [0.5] * 6,
        },
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="gspo", loss_fn_config={"clip_low_threshold": 0.9}
        ),
        model_id="m1",
        seq_id=3,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    decoded = wire.decode_forward_backward(body)
    assert decoded.model_id == "m1" and decoded.seq_id == 3 and decoded.loss_fn == "gspo"
    assert decoded.loss_fn_config == pytest.approx({"clip_low_threshold": 0.9})
    assert decoded.forward_only is False
    (d,) = decoded.data
    assert d.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert d.inputs["target_tokens"].tolist() == [2, 3, 4, 5, 6, 7]
    assert d.inputs["weights"].tolist() == [0, 0, 0, 0, 1, 1]
    assert d.inputs["advantages"].tolist() == [0.5] * 6


def test_sparse_csr_tensor_decodes_to_dense():
    from rlcli.compat.pins import public_pb

    msg = public_pb.Tensor(dtype=public_pb.DTYPE_FLOAT32, shape=[2, 3])
    msg.sparse_csr.values = np.array([5.0, 7.0], dtype=np.float32).tobytes()
    msg.sparse_csr.crow_indices = np.array([0, 1, 2], dtype=np.int64).tobytes()
    msg.sparse_csr.col_indices = np.array([2, 0], dtype=np.int64).tobytes()
    dense = wire._decode_tensor(msg, "x")
    assert dense.tolist() == [[0, 0, 5.0], [7.0, 0, 0]]


def test_the_sdk_parses_what_we_encode():
    outputs = [
        {"logprobs": np.array([-1.0, -2.0], np.float32), "elementwise_loss": np.ones(2)},
        {"logprobs": np.array([-0.5], np.float32), "elementwise_loss": np.zeros(1)},
    ]
    body = wire.encode_forward_backward_output(outputs, {"loss:sum": 3.5})
    parsed = deserialize_forward_backward_output(body)
    assert parsed.metrics == {"loss:sum": 3.5}
    assert len(parsed.loss_fn_outputs) == 2
    assert parsed.loss_fn_outputs[0]["logprobs"].data == [-1.0, -2.0]
    assert parsed.loss_fn_outputs[1]["logprobs"].shape == [1]


def test_garbage_body_is_a_wire_error():
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.decode_forward_backward(b"\xff\xff\xff not protobuf")


def test_non_text_chunks_are_refused_by_name():
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput(
                        chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]
                    ),
                    loss_fn_inputs={"target_tokens": [1]},
                )
            ],
            loss_fn="cross_entropy",
        ),
        model_id="m",
        seq_id=1,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    with pytest.raises(wire.WireError, match=r"data\[0\].model_input.chunks\[0\]: image"):
        wire.decode_forward_backward(body)
