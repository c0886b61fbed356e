"""``train sl --pack``: a batch's short datums packed into fewer, fuller ones, and the results
unpacked back, so the cookbook's loop sees the datums it sent.

A packed datum is its members' tokens, targets and weights end to end, plus the segment each
position belongs to (``SEGMENT_KEY``), from which rlcli's server masks attention to each
member's own earlier positions and restarts positions at each member's start
(``server/engine/training.packed_attention``): every member computes exactly what it would
alone, and the loss, a sum over tokens, is the same. Members are taken in order, a pack
closing when the next one would pass ``max_tokens`` (a longer member is a pack of its own).
"""

from __future__ import annotations

import numpy as np

SEGMENT_KEY = "rlcli_segment_ids"  # the server's losses.PACKING_INPUT (its capabilities name it)


def pack(data: list, max_tokens: int) -> tuple[list, list[list[int]]] | None:
    """(packed datums, the member indices of each) for ``data``; None where packing does not
    apply: image chunks, or K targets per position."""
    from tinker import types

    try:
        tokens = [d.model_input.to_ints() for d in data]
    except (ValueError, TypeError, AttributeError):
        return None
    arrays = [{k: np.asarray(v.to_numpy()) for k, v in d.loss_fn_inputs.items()} for d in data]
    if any(a.ndim != 1 for inputs in arrays for a in inputs.values()):
        return None
    if len({tuple(sorted(inputs)) for inputs in arrays}) > 1:
        return None  # members must carry the same inputs
    groups: list[list[int]] = []
    size = 0
    for i, ids in enumerate(tokens):
        if groups and size + len(ids) <= max_tokens:
            groups[-1].append(i)
            size += len(ids)
        else:
            groups.append([i])
            size = len(ids)
    packed = []
    for group in groups:
        inputs = {
            key: types.TensorData.from_numpy(np.concatenate([arrays[i][key] for i in group]))
            for key in arrays[group[0]]
        }
        segments = np.concatenate([np.full(len(tokens[i]), j) for j, i in enumerate(group)])
        inputs[SEGMENT_KEY] = types.TensorData.from_numpy(segments.astype(np.int64))
        ids = [t for i in group for t in tokens[i]]
        packed.append(
            types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=inputs)
        )
    return packed, groups


def unpack(result, groups: list[list[int]], lengths: list[int]):
    """A packed call's ``ForwardBackwardOutput`` as the unpacked call's: each member's slice
    of every per-token output, in the members' order; the metrics (sums) as they are."""
    from tinker import types

    outputs: list = [None] * len(lengths)
    for group, out in zip(groups, result.loss_fn_outputs, strict=True):
        start = 0
        for i in group:
            outputs[i] = {
                key: types.TensorData(
                    data=list(np.asarray(value.data)[start : start + lengths[i]]),
                    dtype=value.dtype,
                    shape=[lengths[i]],
                )
                for key, value in out.items()
            }
            start += lengths[i]
    return types.ForwardBackwardOutput(
        loss_fn_output_type=result.loss_fn_output_type,
        loss_fn_outputs=outputs,
        metrics=result.metrics,
    )
