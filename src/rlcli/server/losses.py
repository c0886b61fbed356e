"""The loss table: one pure function per wire name, computed on a padded batch in one pass.

Definitions follow the Tinker docs ("Loss Functions"): each loss is the negative objective
**summed** over tokens and datums; ``logprobs`` are the sampler's, ``target_logprobs`` the
model's; PPO-style clip keys are absolute ratio bounds (``clip_low_threshold`` 0.8, not 0.2).
Config keys match SkyRL's server where the two overlap, so one client drives both backends.

Every function gets ``target_logprobs`` [B, T] (with grad), the loss inputs as float [B, T]
tensors (zero-padded), the validity ``mask`` [B, T] and the resolved config, and returns the
scalar loss, the per-token loss, and summed metrics. An optional ``weights`` input scales the
per-token terms of every loss (absent means 1, as on SkyRL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            accepted = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"loss_fn_config: unknown key(s) {unknown}; accepted: {accepted}")
        return {**self.defaults, **given}


def _weights(inputs: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    w = inputs.get("weights")
    return mask.float() if w is None else w * mask


def _finish(per_token: torch.Tensor, **metrics: torch.Tensor) -> LossResult:
    return LossResult(
        loss=per_token.sum(),
        elementwise=per_token.detach(),
        metrics={k: float(v.detach().sum()) for k, v in metrics.items()},
    )


def cross_entropy(logp, inputs, mask, config) -> LossResult:
    weights = inputs["weights"] * mask if "weights" in inputs else mask.float()
    return _finish(-logp * weights)


def importance_sampling(logp, inputs, mask, config) -> LossResult:
    w = _weights(inputs, mask)
    ratio = torch.exp(logp - inputs["logprobs"]) * mask
    return _finish(-(ratio * inputs["advantages"]) * w)


def _clip_ratio(ratio, config):
    return ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])


def ppo(logp, inputs, mask, config) -> LossResult:
    w = _weights(inputs, mask)
    adv = inputs["advantages"]
    ratio = torch.exp(logp - inputs["logprobs"]) * mask
    clipped = _clip_ratio(ratio, config)
    objective = torch.minimum(ratio * adv, clipped * adv)
    return _finish(-objective * w, clipped_tokens=((clipped != ratio) & mask).float())


def cispo(logp, inputs, mask, config) -> LossResult:
    w = _weights(inputs, mask)
    ratio = torch.exp(logp - inputs["logprobs"]) * mask
    clipped = _clip_ratio(ratio, config).detach()
    objective = clipped * logp * inputs["advantages"]
    return _finish(-objective * w, clipped_tokens=((clipped != ratio) & mask).float())


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
}


def unknown_loss_message(name: str) -> str:
    return f"loss_fn: unknown loss {name!r}; supported: {', '.join(sorted(LOSSES))}"
