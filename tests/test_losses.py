"""The loss table against the Tinker docs' definitions, on hand-made tensors (no server)."""

from __future__ import annotations

import pytest
import torch

from rlcli.server.engine import losses


def _batch():
    torch.manual_seed(0)
    logp = (-torch.rand(2, 5) * 2).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    sampler = (logp.detach() + 0.1 * torch.randn(2, 5)) * mask
    adv = torch.tensor([[0, 0, 1.0, 1.0, 1.0], [0, -1.0, -1.0, 0, 0]])
    return logp, mask, {"logprobs": sampler, "advantages": adv}


def _run(name, config=None, **extra):
    logp, mask, inputs = _batch()
    inputs.update(extra)
    spec = losses.LOSSES[name]
    result = spec.fn(logp, inputs, mask, spec.resolve_config(config or {}))
    return result, logp, mask, inputs


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs():
    weights = torch.tensor([[0, 1.0, 1.0, 0.5, 1.0], [1.0, 1.0, 1.0, 9.0, 9.0]])
    result, logp, mask, _ = _run("cross_entropy", weights=weights)
    expected = -(logp * weights * mask).sum()
    assert torch.allclose(result.loss, expected)
    assert torch.allclose(result.elementwise.sum(), expected.detach())


def test_importance_sampling_is_minus_ratio_times_advantage_summed():
    result, logp, mask, inputs = _run("importance_sampling")
    ratio = torch.exp(logp - inputs["logprobs"])
    assert torch.allclose(result.loss, -(ratio * inputs["advantages"] * mask).sum())


def test_ppo_defaults_are_ratio_bounds_0_8_and_1_2():
    spec = losses.LOSSES["ppo"]
    assert spec.resolve_config({}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    result, logp, mask, inputs = _run("ppo", {"clip_low_threshold": 0.95})
    ratio = torch.exp(logp - inputs["logprobs"])
    adv = inputs["advantages"]
    objective = torch.minimum(ratio * adv, ratio.clamp(0.95, 1.2) * adv)
    assert torch.allclose(result.loss, -(objective * mask).sum())


def test_cispo_stops_the_gradient_through_the_clipped_ratio():
    result, logp, mask, inputs = _run("cispo")
    result.loss.backward()
    clipped = torch.exp(logp.detach() - inputs["logprobs"]).clamp(0.0, 4.0)
    assert torch.allclose(logp.grad, -(clipped * inputs["advantages"] * mask))


def test_dro_adds_the_quadratic_penalty_with_beta():
    result, logp, mask, inputs = _run("dro", {"beta": 0.3})
    quad = (logp - inputs["logprobs"]) ** 2
    expected = -((logp * inputs["advantages"] - 0.15 * quad) * mask).sum()
    assert torch.allclose(result.loss, expected)


def test_gspo_ratio_is_the_mean_over_completion_tokens_by_default():
    """The cookbook sends no sequence mask and zero advantages on prompt tokens: the ratio
    must average only the completion (nonzero-advantage) tokens."""
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 10.0}
    result, logp, mask, inputs = _run("gspo", wide)
    adv = inputs["advantages"]
    ratios = []
    for row in range(2):
        action = (adv[row] != 0) & mask[row]
        s = torch.exp((logp[row].detach() - inputs["logprobs"][row])[action].mean())
        ratios.append(float(s))
        # Unclipped, each token's term is -s * A: its value carries the sequence ratio.
        assert torch.allclose(result.elementwise[row], -(s * adv[row] * mask[row]), atol=1e-6)
    assert result.metrics["sequence_ratio"] == pytest.approx(sum(ratios), rel=1e-5)


def test_gspo_explicit_sequence_ratio_mask_wins_over_the_default():
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 10.0}
    only_last = torch.tensor([[0, 0, 0, 0, 1.0], [0, 0, 1.0, 0, 0]])
    result, logp, _, inputs = _run("gspo", wide, sequence_ratio_mask=only_last)
    s0 = torch.exp(logp[0, 4].detach() - inputs["logprobs"][0, 4])
    assert result.elementwise[0, 4] == pytest.approx(float(-s0), rel=1e-5)


def test_gspo_default_clip_is_the_papers_narrow_range():
    config = losses.LOSSES["gspo"].resolve_config({})
    assert config["clip_low_threshold"] == pytest.approx(1 - 3e-4)
    assert config["clip_high_threshold"] == pytest.approx(1 + 4e-4)


def test_dppo_drops_tokens_whose_probability_moved_past_delta_in_the_advantages_direction():
    """SkyRL's Binary-TV rule, on chosen numbers: p - p_sampler past delta_high with a positive
    advantage, or p_sampler - p past delta_low with a negative one, drops the token."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]])).requires_grad_(True)
    sampler = torch.log(torch.tensor([[0.2, 0.45, 0.8, 0.2]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    spec = losses.LOSSES["dppo"]
    config = spec.resolve_config({"delta_low": 0.1, "delta_high": 0.1})
    result = spec.fn(logp, {"logprobs": sampler, "advantages": adv}, mask, config)
    # token 0 (+0.3 with A>0) and token 2 (-0.3 with A<0) are dropped; 1 and 3 stay
    kept = torch.tensor([0.0, 1.0, 0.0, 1.0])
    ratio = torch.exp(logp.detach() - sampler)
    assert torch.allclose(result.loss, -(ratio * adv * kept).sum())
    assert result.metrics["clipped_tokens"] == 2
    result.loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 1] != 0
    assert spec.resolve_config({}) == {"delta_low": 0.2, "delta_high": 0.2}


def test_unknown_config_key_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['eps'\]; accepted: beta"):
        losses.LOSSES["dro"].resolve_config({"eps": 0.1})


def test_unknown_loss_message_lists_every_supported_loss():
    message = losses.unknown_loss_message("grpo")
    for name in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"):
        assert name in message


def test_loss_guard_knows_what_each_backend_serves():
    from rlcli.errors import RlcliError
    from rlcli.recipes import loss_guard

    assert set(loss_guard.BACKEND_LOSSES["torch"]) == set(losses.LOSSES)
    loss_guard.check_backend_hint("fsdp", "gspo")
    loss_guard.check_backend_hint(None, "dro")
    with pytest.raises(RlcliError, match="the jax backend cannot compute loss 'gspo'"):
        loss_guard.check_backend_hint("jax", "gspo")
    with pytest.raises(RlcliError, match="the megatron backend cannot compute loss 'dro'"):
        loss_guard.check_backend_hint("megatron", "dro")
    with pytest.raises(RlcliError, match="--backend tpu: choose from torch, jax"):
        loss_guard.check_backend_hint("tpu", "ppo")


def test_loss_help_says_what_each_backend_serves():
    from rlcli.recipes.options import POLICY_LOSSES, _loss_help

    assert _loss_help() == (
        "Loss computed on the server; torch: all; jax: importance_sampling, ppo, cispo; "
        "fsdp: all but dro; megatron: all but dro."
    )
    assert "ppo_critic" not in POLICY_LOSSES  # a critic's loss: the cookbook loops have none


def test_sampling_filters_apply_top_k_and_top_p_per_row():
    from rlcli.server.engine.sampling import filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = filter_logits(
        logits,
        temperature=torch.ones(3),
        top_k=torch.tensor([2, -1, -1]),
        top_p=torch.tensor([1.0, 0.7, 1.0]),
    )
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [True, True, False, False]  # top-k 2
    assert kept[1].tolist() == [True, True, False, False]  # 0.5 + 0.3 covers p = 0.7
    assert kept[2].all()  # no filter
    probs = out.softmax(-1)
    assert torch.allclose(probs[0, :2], torch.tensor([0.625, 0.375]))
