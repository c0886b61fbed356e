"""``train sl --pack``'s two halves through the unmodified SDK on the shared server: datums
packed by ``compat/packing.py`` give each example the loss, logprobs and gradient it has alone
(attention masked per example, positions restarted), which plain concatenation does not; bad
segment ids answer 400 naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from rlcli.compat import packing

SGD_LIKE = types.AdamParams(learning_rate=1e3, eps=1e6)  # update = -(lr / eps) * gradient


def _datums(tokenizer) -> list[types.Datum]:
    texts = [f"Q: what is {a} times {a + 1}? A: it is {a * (a + 1)}." for a in range(2, 9)]
    data = []
    for text in texts:
        ids = tokenizer.encode(text)
        n = len(ids) - 1
        weights = np.where(np.arange(n) >= n // 2, 1.0, 0.0).astype(np.float32)  # the answer
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights.tolist()},
            )
        )
    return data


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def _logprobs(result) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, np.float64) for o in result.loss_fn_outputs]


def test_packed_examples_train_exactly_as_alone(service, tiny_model, tokenizer):
    data = _datums(tokenizer)
    lengths = [d.model_input.length for d in data]
    packed, groups = packing.pack(data, max_tokens=2 * max(lengths) + 4)
    assert len(packed) < len(data) and sorted(i for g in groups for i in g) == list(range(7))
    alone, together = (
        service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=21).result()
        for _ in range(2)
    )
    for client in (alone, together):  # off the zero LoRA B, so every matrix gets gradient
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    want = alone.forward_backward(data, "cross_entropy").result()
    got = packing.unpack(
        together.forward_backward(packed, "cross_entropy").result(), groups, lengths
    )
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(_logprobs(got), _logprobs(want), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    norm_alone = alone.optim_step(SGD_LIKE).result().metrics["grad_norm:mean"]
    norm_together = together.optim_step(SGD_LIKE).result().metrics["grad_norm:mean"]
    assert norm_alone > 0 and norm_together == pytest.approx(norm_alone, rel=1e-4)
    after = [_logprobs(c.forward(data, "cross_entropy").result()) for c in (alone, together)]
    for a, b in zip(*after, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)

    # The control: the same packs sent without segment ids (plain concatenation) let later
    # examples attend to earlier ones, and their logprobs change.
    plain = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != packing.SEGMENT_KEY},
        )
        for d in packed
    ]
    mixed = packing.unpack(alone.forward(plain, "cross_entropy").result(), groups, lengths)
    second = groups[0][1]
    assert not np.allclose(_logprobs(mixed)[second], after[0][second], atol=1e-3)


def test_bad_segment_ids_answer_400_naming_the_field(service, tiny_model, tokenizer):
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    datum = _datums(tokenizer)[0]
    n = datum.model_input.length
    for ids, message in (
        ([0] * (n - 1) + [2], rf"rlcli_segment_ids\[{n - 1}\]: segment ids go up by 0 or 1"),
        ([1] * n, "segment ids are whole numbers starting at 0"),
    ):
        bad = types.Datum(
            model_input=datum.model_input,
            loss_fn_inputs={
                **datum.loss_fn_inputs,
                packing.SEGMENT_KEY: types.TensorData.from_numpy(np.asarray(ids, np.int64)),
            },
        )
        with pytest.raises(Exception, match=message):
            client.forward_backward([bad], "cross_entropy").result()


def test_the_segment_key_is_the_servers():
    from rlcli.server.engine import losses

    assert packing.SEGMENT_KEY == losses.PACKING_INPUT
