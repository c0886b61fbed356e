"""The loss table: one pure function per wire name, computed on a padded batch in one pass.

Definitions follow the Tinker docs ("Loss Functions"): each loss is the negative objective
**summed** over tokens and datums; ``logprobs`` are the sampler's, ``target_logprobs`` the
model's; PPO-style clip keys are absolute ratio bounds (``clip_low_threshold`` 0.8, not 0.2).
Config keys match SkyRL's server where the two overlap, so one client drives both backends.

Every function gets ``target_logprobs`` [B, T] (with grad), the loss inputs as float [B, T]
tensors (zero-padded), the validity ``mask`` [B, T] and the resolved config, and returns the
scalar loss, the per-token loss, and summed metrics. An optional ``weights`` input scales the
per-token terms of every loss (absent means 1, as on SkyRL).

Importance ratios are exponentiated only where a token can contribute (inside the mask, with a
nonzero advantage and weight): elsewhere the log ratio is 0, so a wild sampler logprob on a
token that does not count can never turn into ``inf * 0 = NaN``. A ratio that overflows on a
token that does count gives a non-finite loss, which the engine refuses (``finite.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class LossResult:
    loss: torch.Tensor  # scalar, summed
    elementwise: torch.Tensor  # [B, T] per-token loss terms
    metrics: dict[str, float] = field(default_factory=dict)  # summed over tokens/datums


LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict], LossResult]


@dataclass(frozen=True)
class LossSpec:
    fn: LossFn
    required: tuple[str, ...]  # loss_fn_inputs every datum must carry (besides target_tokens)
    optional: tuple[str, ...] = ("weights",)
    defaults: dict[str, float] = field(default_factory=dict)  # accepted loss_fn_config keys

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.required + self.optional

    def resolve_config(self, given: dict[str, float]) -> dict[str, float]:
        """The config with defaults filled in; ValueError naming the key for anything unknown,
        non-finite or out of range."""
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            accepted = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"loss_fn_config: unknown key(s) {unknown}; accepted: {accepted}")
        for key, value in given.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"loss_fn_config.{key}: {value!r} is not a number")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"loss_fn_config.{key}: {value!r} must be a finite number >= 0")
        config = {**self.defaults, **{k: float(v) for k, v in given.items()}}
        if config.get("clip_low_threshold", 0.0) > config.get("clip_high_threshold", math.inf):
            raise ValueError(
                f"loss_fn_config: clip_low_threshold {config['clip_low_threshold']} is above "
                f"clip_high_threshold {config['clip_high_threshold']}"
            )
        return config


def _weights(inputs: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    w = inputs.get("weights")
    return mask.float() if w is None else w * mask


def _ratio(logp, inputs, mask, w) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp(logp - sampler logp) where the token counts and 1 elsewhere, where it counts)."""
    counts = mask & (inputs["advantages"] != 0) & (w != 0)
    return torch.exp(torch.where(counts, logp - inputs["logprobs"], 0.0)), counts


def _finish(per_token: torch.Tensor, **metrics: torch.Tensor) -> LossResult:
    return LossResult(
        loss=per_token.sum(),
        elementwise=per_token.detach(),
        metrics={k: float(v.detach().sum()) for k, v in metrics.items()},
    )


def cross_entropy(logp, inputs, mask, config) -> LossResult:
    """-sum(weights * logp). ``logp`` and ``weights`` may be [B, T, K] (Tinker's top-K
    distillation: K target tokens per position, each with its own weight)."""
    if logp.dim() == 3:
        mask = mask.unsqueeze(-1)
    return _finish(-logp * _weights(inputs, mask))


def importance_sampling(logp, inputs, mask, config) -> LossResult:
    w = _weights(inputs, mask)
    ratio, _ = _ratio(logp, inputs, mask, w)
    return _finish(-(ratio * inputs["advantages"]) * w)


def _clip_ratio(ratio, config):
    return ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])


def ppo(logp, inputs, mask, config) -> LossResult:
    w = _weights(inputs, mask)
    adv = inputs["advantages"]
    ratio, counts = _ratio(logp, inputs, mask, w)
    clipped = _clip_ratio(ratio, config)
    objective = torch.minimum(ratio * adv, clipped * adv)
    return _finish(-objective * w, clipped_tokens=((clipped != ratio) & counts).float())


def cispo(logp, inputs, mask, config) -> LossResult:
    w = _weights(inputs, mask)
    ratio, counts = _ratio(logp, inputs, mask, w)
    clipped = _clip_ratio(ratio, config).detach()
    objective = clipped * logp * inputs["advantages"]
    return _finish(-objective * w, clipped_tokens=((clipped != ratio) & counts).float())


def dro(logp, inputs, mask, config) -> LossResult:
    w = _weights(inputs, mask)
    quadratic = (logp - inputs["logprobs"]) ** 2
    objective = logp * inputs["advantages"] - 0.5 * config["beta"] * quadratic
    return _finish(-objective * w)


def gspo(logp, inputs, mask, config) -> LossResult:
    """GSPO-token: every token carries its sequence's ratio s = exp(mean_t(logp - q)) as value,
    and its own gradient; clipped PPO-style. The mean runs over ``sequence_ratio_mask`` != 0,
    by default the tokens with a nonzero advantage: the sampled completion, as the cookbook
    zeroes prompt advantages and sends no mask."""
    w = _weights(inputs, mask)
    adv = inputs["advantages"]
    ratio_mask = inputs.get("sequence_ratio_mask")
    in_ratio = (ratio_mask != 0) if ratio_mask is not None else (adv != 0)
    in_ratio = in_ratio & mask
    counts = in_ratio.sum(-1).clamp(min=1)
    log_ratio = ((logp.detach() - inputs["logprobs"]) * in_ratio).sum(-1) / counts  # [B]
    seq_log_ratio = log_ratio.unsqueeze(-1) + logp - logp.detach()
    ratio = torch.exp(seq_log_ratio.clamp(max=20.0)) * mask
    clipped = _clip_ratio(ratio, config)
    objective = torch.minimum(ratio * adv, clipped * adv)
    return _finish(
        -objective * w,
        clipped_tokens=((clipped != ratio) & in_ratio).float(),
        sequence_ratio=torch.exp(log_ratio).detach(),
    )


def dppo(logp, inputs, mask, config) -> LossResult:
    """DPPO (Binary-TV, SkyRL's ``dppo_policy_loss``, arXiv 2602.04879): the importance-
    sampling surrogate ``-ratio * advantage``, with a token dropped (no gradient, no value)
    where the policy's probability has already moved past a bound in the advantage's
    direction: ``p - p_sampler > delta_high`` with a positive advantage, ``p_sampler - p >
    delta_low`` with a negative one. Probabilities, not ratios: a rare token may move far in
    ratio, a common one only a little. The mask is computed without gradient."""
    w = _weights(inputs, mask)
    adv = inputs["advantages"]
    ratio, counts = _ratio(logp, inputs, mask, w)
    with torch.no_grad():
        sampler = torch.where(counts, inputs["logprobs"], 0.0)
        moved = torch.exp(torch.where(counts, logp, 0.0)) - torch.exp(sampler)
        dropped = ((adv > 0) & (moved > config["delta_high"])) | (
            (adv < 0) & (-moved > config["delta_low"])
        )
        dropped = dropped & counts
    objective = ratio * adv * (~dropped).float()
    return _finish(-objective * w, clipped_tokens=dropped.float())


def ppo_critic(values, inputs, mask, config) -> LossResult:
    """PPO's value loss (SkyRL's ``ppo_critic_loss``) for a critic training client: its first
    argument is the critic's values [B, T], not logprobs. ``values`` in the inputs are the
    values at rollout time, ``returns`` the targets; a new value may move at most
    ``value_clip`` from the old one before the clipped term takes over:
    ``0.5 * max((old + clip(v - old) - R)^2, (v - R)^2)``, summed like every loss here
    (SkyRL averages per sequence, then over the batch)."""
    w = _weights(inputs, mask)
    old, returns = inputs["values"], inputs["returns"]
    clip = config["value_clip"]
    clipped = old + (values - old).clamp(-clip, clip)
    surr_clipped, surr = (clipped - returns) ** 2, (values - returns) ** 2
    return _finish(
        0.5 * torch.maximum(surr_clipped, surr) * w,
        clipped_tokens=((surr_clipped > surr) & mask & (w != 0)).float(),
    )


# Sampler/trainer agreement, reported by every loss that receives the sampler's logprobs.
# Names carry rlcli's prefix (no SDK or cookbook metric starts with it) and exactly one ':'
# reduction suffix, which the SDK uses to merge chunked results (sum, max).
MISMATCH_SUM = "rlcli/logp_diff_sum:sum"  # sum over sampled tokens of |logp_train - logp_sampler|
MISMATCH_MAX = "rlcli/logp_diff_max:max"  # the largest of them
MISMATCH_TOKENS = "rlcli/logp_diff_tokens:sum"  # sampled tokens counted
RATIO_OUTSIDE = "rlcli/ratio_outside_count:sum"  # of those, ratio exp(diff) outside [0.5, 2]


def sampler_mismatch(logp, inputs, mask) -> dict[str, float]:
    """|logp_train - logp_sampler| over the tokens the sampler produced (in the mask, with a
    nonzero sampler logprob or advantage: the cookbook sends 0 for both on prompt tokens):
    its sum, max and count, and how many importance ratios leave [0.5, 2]."""
    sampled = mask & ((inputs["logprobs"] != 0) | (inputs.get("advantages", 0.0) != 0))
    diff = (logp.detach() - inputs["logprobs"]).abs()[sampled]
    if diff.numel() == 0:
        return {MISMATCH_SUM: 0.0, MISMATCH_MAX: 0.0, MISMATCH_TOKENS: 0.0, RATIO_OUTSIDE: 0.0}
    return {
        MISMATCH_SUM: float(diff.sum()),
        MISMATCH_MAX: float(diff.max()),
        MISMATCH_TOKENS: float(diff.numel()),
        RATIO_OUTSIDE: float((diff > math.log(2.0)).sum()),
    }


_CLIP_08_12 = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, required=(), optional=("weights",)),
    "importance_sampling": LossSpec(importance_sampling, required=("logprobs", "advantages")),
    "ppo": LossSpec(ppo, required=("logprobs", "advantages"), defaults=_CLIP_08_12),
    # Tinker's documented CISPO default is one-sided: only large ratios are capped.
    "cispo": LossSpec(
        cispo,
        required=("logprobs", "advantages"),
        defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    ),
    "dro": LossSpec(dro, required=("logprobs", "advantages"), defaults={"beta": 0.05}),
    # The GSPO paper's clip ranges (3e-4, 4e-4) around a ratio of 1.
    "gspo": LossSpec(
        gspo,
        required=("logprobs", "advantages"),
        optional=("weights", "sequence_ratio_mask"),
        defaults={"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    ),
    # SkyRL's DPPOConfig defaults (0.2 for Binary-TV); its Tinker server takes the same keys.
    "dppo": LossSpec(
        dppo,
        required=("logprobs", "advantages"),
        defaults={"delta_low": 0.2, "delta_high": 0.2},
    ),
    # A critic's loss (training clients created with model_role "critic"); SkyRL's default.
    "ppo_critic": LossSpec(
        ppo_critic, required=("values", "returns"), defaults={"value_clip": 0.2}
    ),
}
CRITIC_LOSSES = ("ppo_critic", "ppo")  # what a critic accepts ("ppo": SkyRL routes it so)


# Losses tinker 0.38 names that this server does not compute, and what to use instead.
NOT_SERVED = {
    "stable_reinforce": "its objective is not published; use importance_sampling or ppo",
    "custom": "server-side custom losses are off here; forward_backward_custom runs the loss "
    "on the client",
}


def critic_config(loss_fn: str, given: dict[str, float]) -> dict[str, float]:
    """A critic's resolved ``ppo_critic`` config for a request naming ``loss_fn``; ValueError
    naming the field for a loss a critic does not train with. ``ppo`` is accepted as SkyRL
    accepts it (the SDK's loss names have no ``ppo_critic``), its ratio clips ignored."""
    if loss_fn not in CRITIC_LOSSES:
        raise ValueError(
            f"loss_fn: {loss_fn!r} is a policy loss; a critic training client (model_role "
            f"'critic') trains with {' or '.join(CRITIC_LOSSES)}"
        )
    if loss_fn == "ppo":
        given = {
            k: v for k, v in given.items() if k not in ("clip_low_threshold", "clip_high_threshold")
        }
    return LOSSES["ppo_critic"].resolve_config(given)


def unknown_loss_message(name: str) -> str:
    supported = ", ".join(sorted(LOSSES))
    if name in NOT_SERVED:
        return f"loss_fn: {name!r} is not served here ({NOT_SERVED[name]}); supported: {supported}"
    return f"loss_fn: unknown loss {name!r}; supported: {supported}"


# Several short examples packed into one datum (``train sl --pack``): the segment each position
# belongs to (0, 1, ...; non-decreasing). A position attends only to its own segment's earlier
# positions and counts its position from its segment's start, so each example computes exactly
# what it would alone. Sent as one more loss_fn_inputs array, the only per-token channel of a
# Tinker datum; rlcli's own (the capabilities say so), checked in ``http/tinker/validate.py``,
# applied in ``training.packed_attention``.
PACKING_INPUT = "rlcli_segment_ids"


def default_input(name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The value of an optional input that a datum left out. Each datum is self-contained, as
    in Tinker: a batch may mix datums with and without ``weights``."""
    if name == "sequence_ratio_mask":
        return (inputs["advantages"] != 0).astype(np.float32)
    return np.ones(inputs["target_tokens"].shape, np.float32)  # weights: every token counts


def config_defaults() -> dict[str, dict[str, float]]:
    """Each loss's accepted ``loss_fn_config`` keys and defaults (listed in capabilities)."""
    return {name: dict(spec.defaults) for name, spec in sorted(LOSSES.items())}
