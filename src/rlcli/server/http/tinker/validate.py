"""Checks on a decoded request before it reaches the engine, so bad input answers 400 at once
with the field named (``data[3].loss_fn_inputs.advantages: ...``) and the engine never sees it."""

from __future__ import annotations

import numpy as np

from rlcli.server.engine import losses
from rlcli.server.errors import InvalidPayload
from rlcli.server.wire import FwdBwdRequest

# Keys some clients send alongside the loss inputs and that no loss reads (the cookbook's RL
# datums carry "mask" until it strips them); accepted and ignored rather than refused.
IGNORED_INPUTS = {"mask"}


class RequestError(InvalidPayload):
    """Invalid request; the message names the field."""


def validate_forward_backward(
    req: FwdBwdRequest, vocab_size: int, max_context: int, critic: bool = False
) -> None:
    """``critic``: the training client is a critic (``model_role`` "critic"): it trains with
    ``ppo_critic`` (or ``ppo``, as on SkyRL), and a forward may leave its inputs out (it
    returns the values)."""
    spec = losses.LOSSES.get(req.loss_fn)
    if spec is None:
        raise RequestError(losses.unknown_loss_message(req.loss_fn))
    required = spec.required
    try:
        if critic:
            spec = losses.LOSSES["ppo_critic"]
            required = () if req.forward_only else spec.required
            if not req.forward_only:
                losses.critic_config(req.loss_fn, req.loss_fn_config)
        else:
            spec.resolve_config(req.loss_fn_config)
    except ValueError as e:
        raise RequestError(str(e)) from None
    if req.loss_fn == "ppo_critic" and not critic:
        raise RequestError(
            "loss_fn: 'ppo_critic' trains a critic; create the training client with "
            "model_role 'critic' (the create_model body, or user_metadata)"
        )
    if not req.data:
        raise RequestError("data: empty; send at least one datum")
    allowed = {"target_tokens", losses.PACKING_INPUT, *spec.inputs}
    for i, datum in enumerate(req.data):
        where = f"data[{i}]"
        n = len(datum.tokens)
        if n == 0:
            raise RequestError(f"{where}.model_input: empty; a datum needs at least one token")
        if n > max_context:
            raise RequestError(
                f"{where}.model_input: {n} tokens exceeds the model's context of {max_context}"
            )
        check_token_ids(datum.tokens, vocab_size, f"{where}.model_input")
        _check_spans(datum.input_spans, n, f"{where}.model_input_spans", "model_input tokens")
        targets = len(datum.inputs.get("target_tokens", ()))
        _check_spans(datum.target_spans, targets, f"{where}.loss_fn_input_spans", "target_tokens")
        for name in ("target_tokens", *required):
            if name not in datum.inputs:
                raise RequestError(
                    f"{where}.loss_fn_inputs.{name}: missing; loss {req.loss_fn!r} needs "
                    f"{', '.join(('target_tokens', *required))}"
                )
        # Top-K distillation (cross_entropy only): K target tokens per position, [N, K].
        target_shape = datum.inputs["target_tokens"].shape
        if target_shape[1:] and (req.loss_fn != "cross_entropy" or critic):
            raise RequestError(
                f"{where}.loss_fn_inputs.target_tokens: shape {list(target_shape)}; only "
                "cross_entropy takes K targets per position, other losses take [N]"
            )
        if target_shape[1:] != req.data[0].inputs["target_tokens"].shape[1:]:
            raise RequestError(
                f"{where}.loss_fn_inputs.target_tokens: shape {list(target_shape)}, but "
                f"data[0] has {list(req.data[0].inputs['target_tokens'].shape)}; one K per batch"
            )
        for name, arr in datum.inputs.items():
            field = f"{where}.loss_fn_inputs.{name}"
            if name in IGNORED_INPUTS:
                continue
            if name not in allowed:
                raise RequestError(
                    f"{field}: not an input of loss {req.loss_fn!r} "
                    f"(it takes {', '.join(sorted(allowed))})"
                )
            expected = [n, *target_shape[1:]] if name in ("target_tokens", "weights") else [n]
            if list(arr.shape) != expected:
                raise RequestError(
                    f"{field}: shape {list(arr.shape)}, expected {expected} "
                    "(one value per model_input token)"
                )
            if name == "target_tokens":
                check_token_ids(arr, vocab_size, field)
            elif name == losses.PACKING_INPUT:
                _check_segments(arr, field)
            elif not np.all(np.isfinite(arr)):
                raise RequestError(f"{field}: contains NaN or infinity")


def _check_segments(ids: np.ndarray, field: str) -> None:
    """A packed datum's segment ids: whole numbers from 0, each the same as the one before or
    one more (a segment is a run of positions)."""
    if not np.all(np.isfinite(ids)) or not np.all(ids == np.round(ids)) or ids[0] != 0:
        raise RequestError(f"{field}: segment ids are whole numbers starting at 0")
    steps = np.diff(ids)
    if np.any((steps != 0) & (steps != 1)):
        at = int(np.flatnonzero((steps != 0) & (steps != 1))[0]) + 1
        raise RequestError(
            f"{field}[{at}]: segment ids go up by 0 or 1 from one position to the next"
        )


def _check_spans(lengths: list[int] | None, total: int, field: str, what: str) -> None:
    """Provenance spans (tinker>=0.38) tile what they annotate: their lengths add up to it."""
    if lengths is not None and sum(lengths) != total:
        raise RequestError(
            f"{field}: the runs cover {sum(lengths)} positions; they must tile the {total} {what}"
        )


def check_token_ids(ids: np.ndarray, vocab_size: int, field: str) -> None:
    if ids.dtype.kind == "f" and not np.all(ids == np.round(ids)):
        raise RequestError(f"{field}: token ids must be integers")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise RequestError(
            f"{field}[{pos}]: token id {int(ids[pos])} is outside the vocabulary "
            f"(0..{vocab_size - 1})"
        )
