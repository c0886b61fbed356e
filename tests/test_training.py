"""End to end through the unmodified tinker 0.25.0 SDK against a real server process:
every loss trains, fused losses match the SDK's client-side 2-pass path, adapters are isolated."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

RL_LOSSES = ["importance_sampling", "ppo", "cispo", "dro", "gspo", "dppo"]
# Ratio bounds wide enough that some tokens clip and some do not at noise 0.05.
WIDE_CLIP = {"clip_low_threshold": 0.97, "clip_high_threshold": 1.03}
# dppo: probability bounds; the two-pass test sets them where some tokens move past them.
CONFIGS = {
    "ppo": WIDE_CLIP,
    "cispo": WIDE_CLIP,
    "gspo": WIDE_CLIP,
    "dro": {"beta": 0.5},
    "dppo": {"delta_low": 1e-4, "delta_high": 1e-4},
}
# lr / eps both large: Adam's first step becomes plain SGD, update = -(lr / eps) * grad,
# so weights after one step reflect the whole gradient, not just its signs.
SGD_LIKE = types.AdamParams(learning_rate=1e3, eps=1e6, beta1=0.9, beta2=0.95)


def _sequences(tokenizer, n: int = 6) -> list[list[int]]:
    texts = [f"What is {a} + {a + 3}? The answer is {2 * a + 3}." for a in range(1, n + 1)]
    return [tokenizer.encode(t) for t in texts]


def _prompt_len(seq: list[int]) -> int:
    return max(2, len(seq) // 2)


def _forward_logprobs(trainer, seqs) -> list[np.ndarray]:
    data = [_ce_datum(s, weight_all=True) for s in seqs]
    out = trainer.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].data, dtype=np.float64) for o in out.loss_fn_outputs]


def _ce_datum(seq: list[int], weight_all: bool = False) -> types.Datum:
    p = _prompt_len(seq)
    weights = [1.0] * (len(seq) - 1) if weight_all else [0.0] * (p - 1) + [1.0] * (len(seq) - p)
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
    )


def _rl_batch(seqs, current_logprobs, seed: int = 0):
    """Datums shaped like the cookbook's: prompt tokens carry zero advantage and logprob."""
    rng = np.random.default_rng(seed)
    data, extras = [], []
    for i, (seq, logp) in enumerate(zip(seqs, current_logprobs, strict=True)):
        n = len(seq) - 1
        p = _prompt_len(seq) - 1
        action = np.zeros(n, dtype=bool)
        action[p:] = True
        sampler = np.where(action, logp + rng.normal(0, 0.05, n), 0.0).astype(np.float32)
        adv_value = 1.0 if i % 2 == 0 else -1.0
        advantages = np.where(action, adv_value, 0.0).astype(np.float32)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={
                    "target_tokens": seq[1:],
                    "logprobs": sampler.tolist(),
                    "advantages": advantages.tolist(),
                },
            )
        )
        extras.append((torch.tensor(sampler), torch.tensor(advantages)))
    return data, extras


def _reference_loss(name: str, config: dict, logprobs_list, extras) -> torch.Tensor:
    """The Tinker docs' definitions, written out per sequence in plain torch, independently
    of the server's batched implementation."""
    total = torch.zeros(())
    for logp, (sampler, adv) in zip(logprobs_list, extras, strict=True):
        logp = logp.float()
        if name == "importance_sampling":
            total = total - (torch.exp(logp - sampler) * adv).sum()
        elif name in ("ppo", "cispo"):
            ratio = torch.exp(logp - sampler)
            low, high = config["clip_low_threshold"], config["clip_high_threshold"]
            clipped = ratio.clamp(low, high)
            if name == "ppo":
                total = total - torch.minimum(ratio * adv, clipped * adv).sum()
            else:
                total = total - (clipped.detach() * logp * adv).sum()
        elif name == "dro":
            quad = (logp - sampler) ** 2
            total = total - (logp * adv - 0.5 * config["beta"] * quad).sum()
        elif name == "gspo":
            action = adv != 0
            seq_log_ratio = (logp.detach() - sampler)[action].mean()
            ratio = torch.exp(seq_log_ratio + logp - logp.detach())
            clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
            total = total - torch.minimum(ratio * adv, clipped * adv).sum()
        elif name == "dppo":  # SkyRL's dppo_policy_loss (Binary-TV), without its token mean
            moved = torch.exp(logp.detach()) - torch.exp(sampler)
            keep = torch.ones_like(adv)
            keep[(adv > 0) & (moved > config["delta_high"])] = 0.0
            keep[(adv < 0) & (-moved > config["delta_low"])] = 0.0
            total = total - (torch.exp(logp - sampler) * adv * keep).sum()
        else:
            raise AssertionError(name)
    return total


@pytest.fixture(scope="module")
def tokenizer(service, tiny_model):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=0
    ).result()
    return trainer.get_tokenizer()


def test_cross_entropy_step_lowers_the_loss(service, tiny_model, tokenizer):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=1
    ).result()
    data = [_ce_datum(s) for s in _sequences(tokenizer)]
    losses = []
    for _ in range(4):
        result = trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(result.metrics["loss:sum"])
    after = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after < losses[0] * 0.9, (losses, after)
    # Outputs are per datum and per token, as the cookbook reads them.
    assert len(result.loss_fn_outputs) == len(data)
    assert len(result.loss_fn_outputs[0]["logprobs"].data) == data[0].model_input.length


@pytest.mark.parametrize("loss_fn", RL_LOSSES)
def test_rl_loss_step_lowers_that_loss(service, tiny_model, tokenizer, loss_fn):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=2
    ).result()
    seqs = _sequences(tokenizer)
    data, _ = _rl_batch(seqs, _forward_logprobs(trainer, seqs))
    config = CONFIGS.get(loss_fn)
    before = trainer.forward(data, loss_fn, config).result().metrics["loss:sum"]
    for _ in range(3):
        trainer.forward_backward(data, loss_fn, config).result()
        trainer.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    after = trainer.forward(data, loss_fn, config).result().metrics["loss:sum"]
    assert after < before, (loss_fn, before, after)


@pytest.mark.parametrize("loss_fn", RL_LOSSES)
def test_fused_loss_matches_two_pass_forward_backward_custom(
    service, tiny_model, tokenizer, loss_fn
):
    """Same seed, same batch: the fused server loss and the SDK's 2-pass custom loss give the
    same gradient (norm from optim_step) and the same weights after one SGD-like step."""
    config = CONFIGS.get(loss_fn, {})
    fused = service.create_lora_training_client(base_model=str(tiny_model), rank=8, seed=3).result()
    two_pass = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=3
    ).result()
    seqs = _sequences(tokenizer)
    # Move both off the zero-initialised LoRA B with one identical step, so that every LoRA
    # matrix, not only B, receives gradient in the comparison.
    for trainer in (fused, two_pass):
        trainer.forward_backward([_ce_datum(s) for s in seqs], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    current = _forward_logprobs(fused, seqs)
    data, extras = _rl_batch(seqs, current, seed=7)
    if loss_fn == "dppo":  # bounds at the median probability move: half the tokens drop
        moved = np.concatenate(
            [
                np.abs(np.exp(c) - np.exp(s.numpy()))[a.numpy() != 0]
                for c, (s, a) in zip(current, extras, strict=True)
            ]
        )
        median = float(np.median(moved))
        config = {"delta_low": median, "delta_high": median}

    fused_out = fused.forward_backward(data, loss_fn, config or None).result()
    fused_norm = fused.optim_step(SGD_LIKE).result().metrics["grad_norm:mean"]

    def custom_loss(batch, logprobs_list):
        loss = _reference_loss(loss_fn, config, logprobs_list, extras)
        return loss, {"reference_loss": float(loss.detach())}

    plain = [
        types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": s[1:]})
        for d, s in zip(data, seqs, strict=True)
    ]
    custom_out = two_pass.forward_backward_custom(plain, custom_loss).result()
    custom_norm = two_pass.optim_step(SGD_LIKE).result().metrics["grad_norm:mean"]

    assert fused_out.metrics["loss:sum"] == pytest.approx(
        custom_out.metrics["reference_loss"], rel=1e-4, abs=1e-4
    )
    assert fused_norm > 0
    assert fused_norm == pytest.approx(custom_norm, rel=1e-3)
    if loss_fn == "dppo":  # the bounds drop some tokens and keep others
        action_tokens = sum(int((adv != 0).sum()) for _, adv in extras)
        assert 0 < fused_out.metrics["clipped_tokens:sum"] < action_tokens
    for a, b in zip(_forward_logprobs(fused, seqs), _forward_logprobs(two_pass, seqs), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)


def test_two_training_clients_train_independently(service, tiny_model, tokenizer):
    seqs = _sequences(tokenizer)
    first = service.create_lora_training_client(base_model=str(tiny_model), rank=8, seed=4).result()
    second = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=5
    ).result()
    base = _forward_logprobs(second, seqs)  # zero-initialised LoRA B: equals the base model
    data = [_ce_datum(s) for s in seqs]
    for _ in range(3):
        first.forward_backward(data, "cross_entropy").result()
        first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained_first = _forward_logprobs(first, seqs)
    assert not np.allclose(trained_first[0], base[0], atol=1e-3)
    for a, b in zip(_forward_logprobs(second, seqs), base, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)  # untouched by the other client's training
    # Gradients accumulated on one adapter never reach another's optimizer step.
    second.forward_backward(data[:2], "cross_entropy").result()
    first.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # no pending grads: no-op
    for a, b in zip(_forward_logprobs(first, seqs), trained_first, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    second.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert not np.allclose(_forward_logprobs(second, seqs)[0], base[0], atol=1e-3)


def test_optim_step_applies_weight_decay_and_grad_clipping(service, tiny_model, tokenizer):
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=6
    ).result()
    data = [_ce_datum(s) for s in _sequences(tokenizer)]
    trainer.forward_backward(data, "cross_entropy").result()
    clipped = trainer.optim_step(
        types.AdamParams(learning_rate=1e-3, grad_clip_norm=0.5, weight_decay=0.1)
    ).result()
    # The reported norm is the one before clipping; the step itself succeeded.
    assert clipped.metrics["grad_norm:mean"] > 0.5


def test_sdk_tokenizer_loads_offline_from_get_info(service, tiny_model):
    trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    info = trainer.get_info()
    assert info.model_data.tokenizer_id == str(tiny_model)
    assert info.lora_rank == 4
    assert trainer.get_tokenizer().eos_token == "<|im_end|>"
    assert isinstance(trainer, tinker.TrainingClient)


# ---- a critic: model_role "critic", a value head trained with ppo_critic (SkyRL's) ---------


def _critic(service, tiny_model, seed: int):
    return service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=seed, user_metadata={"model_role": "critic"}
    ).result()


def _value_datums(seqs, old_values=None, returns=None) -> list[types.Datum]:
    data = []
    for i, seq in enumerate(seqs):
        inputs = {"target_tokens": seq[1:]}
        if old_values is not None:
            # TensorData: the SDK converts lists only for the keys it knows
            inputs["values"] = types.TensorData.from_numpy(np.asarray(old_values[i], np.float32))
            inputs["returns"] = types.TensorData.from_numpy(np.asarray(returns[i], np.float32))
        data.append(
            types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)
        )
    return data


def _values(critic, seqs) -> list[np.ndarray]:
    out = critic.forward(_value_datums(seqs), "ppo").result()  # as SkyRL's PPO example asks
    return [np.asarray(o["values"].data, dtype=np.float64) for o in out.loss_fn_outputs]


def test_ppo_critic_is_skyrls_clipped_value_loss_and_trains_the_values(
    service, tiny_model, tokenizer
):
    """The loss on the server equals 0.5 * max((old + clip(v - old) - R)^2, (v - R)^2) summed,
    computed here by hand from the values the critic's forward returned; steps move the values
    toward the returns."""
    seqs = _sequences(tokenizer)
    critic = _critic(service, tiny_model, seed=11)
    values = _values(critic, seqs)
    assert [len(v) for v in values] == [len(s) - 1 for s in seqs]
    rng = np.random.default_rng(0)
    old = [(v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for v in values]
    returns = [rng.normal(1.0, 0.5, v.shape).astype(np.float32) for v in values]
    clip = 0.2
    expected, clipped_count = 0.0, 0
    for v, o, r in zip(values, old, returns, strict=True):
        surr_clipped = (o + np.clip(v - o, -clip, clip) - r) ** 2
        surr = (v - r) ** 2
        expected += 0.5 * np.maximum(surr_clipped, surr).sum()
        clipped_count += int((surr_clipped > surr).sum())
    data = _value_datums(seqs, old, returns)
    out = critic.forward_backward(data, "ppo_critic", {"value_clip": clip}).result()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    assert 0 < out.metrics["clipped_tokens:sum"] == clipped_count
    assert len(out.loss_fn_outputs[0]["values"].data) == len(seqs[0]) - 1
    critic.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    error = [np.abs(v - r).mean() for v, r in zip(values, returns, strict=True)]
    for _ in range(5):  # wide clip: the plain squared error toward the returns
        critic.forward_backward(data, "ppo_critic", {"value_clip": 100.0}).result()
        critic.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [np.abs(v - r).mean() for v, r in zip(_values(critic, seqs), returns, strict=True)]
    assert np.mean(after) < 0.7 * np.mean(error), (error, after)


def test_a_critic_refuses_policy_work_and_restores_exactly(service, tiny_model, tokenizer):
    from rlcli.server.http.tinker.schemas import CreateModel

    seqs = _sequences(tokenizer, 3)
    critic = _critic(service, tiny_model, seed=12)
    policy = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    data, _ = _rl_batch(seqs, _forward_logprobs(policy, seqs))
    with pytest.raises(Exception, match="critic training client .* trains with ppo_critic or ppo"):
        critic.forward_backward(data, "importance_sampling").result()
    values = _values(critic, seqs)
    with pytest.raises(Exception, match="'ppo_critic' trains a critic; create the training"):
        policy.forward_backward(_value_datums(seqs, values, values), "ppo_critic").result()
    with pytest.raises(Exception, match="is a critic: it gives values, not tokens"):
        critic.save_weights_and_get_sampling_client().result().sample(
            types.ModelInput.from_ints(seqs[0][:3]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    # Its checkpoint holds the value head: a client made from it (a critic, as its run was)
    # gives the same values; a policy client (no value head) refuses it, naming the tensor.
    path = critic.save_state("critic-ckpt").result().path
    made = service.create_training_client_from_state(path).result()
    for a, b in zip(_values(made, seqs), values, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    fresh = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    with pytest.raises(Exception, match="rlcli_value_head.weight"):
        fresh.load_state(path).result()
    # SkyRL's own spelling: the create_model body's model_role.
    body = {"session_id": "s", "base_model": "m", "model_role": "critic"}
    assert CreateModel.model_validate(body).model_role == "critic"
