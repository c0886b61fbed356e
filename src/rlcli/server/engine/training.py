"""The engine's training half: every loss fused into one forward (+ one backward) pass per
micro-batch, and AdamW on the adapter's accumulated gradients.

``Training`` is a part of ``core.Engine`` (which inherits it), kept apart so the training path
reads on its own: rows are packed into micro-batches (``shared_prefix.microbatches``; rows
that begin alike run their shared beginning once), the target logprobs come from the final
hidden states a chunk at a time (``logprobs.py``), the loss is the table's pure function
(``losses.py``), and nothing non-finite reaches the adapter (``finite.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from rlcli.server.engine import activations, finite, logprobs, losses, shared_prefix
from rlcli.server.errors import UserError
from rlcli.server.wire import DatumArrays

log = logging.getLogger("rlcli.engine")

# optim_step metrics: the step's sampler/trainer agreement (``step_mismatch``)
STEP_MISMATCH_MEAN = "rlcli/logp_diff_mean:mean"
STEP_MISMATCH_MAX = "rlcli/logp_diff_max:max"
STEP_RATIO_OUTSIDE = "rlcli/ratio_outside_frac:mean"


@dataclass
class Adapter:
    """A training client's LoRA: its parameters and optimizer (its config is peft's)."""

    name: str
    rank: int
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0
    # a critic's value head (model_role "critic"): its forward gives values, its loss ppo_critic
    value_head: torch.nn.Linear | None = None
    # sampler/trainer mismatch summed over the forward_backward calls since the last step
    mismatch: dict[str, float] = field(default_factory=dict)


class Training:
    """``Engine``'s forward_backward and optim_step (the attributes below are the Engine's)."""

    model: torch.nn.Module
    device: torch.device
    pad_id: int
    vocab_size: int
    microbatch_tokens: int
    share_prefixes: bool
    adapters: dict[str, Adapter]
    _split_head: bool
    _compact_activations: bool
    _checkpoint_above: float
    _checkpoint_layers: list[torch.nn.Module]

    def _enable_checkpointing(self) -> list[torch.nn.Module]:
        """Turn on transformers' per-layer checkpointing (non-reentrant: correct with frozen
        base weights and LoRA, no inputs that require grad needed); the layers it covers.

        transformers checkpoints a layer only while that layer is in training mode, and the
        model stays in eval mode (no dropout), so ``_checkpointing`` flips just those layers'
        own flag around a training forward; sampling never sees it (it keeps its KV cache)."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        try:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        except ValueError as e:  # an architecture transformers cannot checkpoint
            log.warning("gradient checkpointing is off: %s", e)
            return []
        return [m for m in self.model.modules() if isinstance(m, GradientCheckpointingLayer)]

    @contextlib.contextmanager
    def _checkpointing(self, padded_tokens: int):
        """Checkpoint the layers for a training forward of ``padded_tokens`` (see
        ``checkpoint_above``); forward-only passes never. Yields whether it does, which the
        output layer's chunks follow (``logprobs.target_logprobs``'s ``recompute``)."""
        wanted = torch.is_grad_enabled() and padded_tokens > self._checkpoint_above
        layers = self._checkpoint_layers if wanted else []
        for layer in layers:
            layer.training = True
        try:
            yield wanted
        finally:
            for layer in layers:
                layer.training = False

    def _keeping(self) -> contextlib.AbstractContextManager:
        """Around a training forward: what it saves for the backward kept as bf16 copies
        where the engine computes in bf16 on a CPU (``activations.py``)."""
        if not (self._compact_activations and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        return activations.compact(activations.model_storages(self.model))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits, as the model's own forward computes them (the output
        layer, with its LoRA if one is active, in the model's dtype; then a logit soft-cap if
        the architecture has one)."""
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _hidden_states(self, tokens: torch.Tensor, packing: dict | None = None) -> torch.Tensor:
        """The decoder's output for right-padded rows. No attention mask: causality alone
        keeps each real position from the padding after it (a padded position's output is
        never read), and SDPA's causal kernel skips what a mask would only hide (~1.5% of a
        bf16 forward_backward of 8 RL rows, identical logprobs and gradients). ``packing``:
        a packed batch's mask and positions (``packed_attention``)."""
        out = self.model.get_decoder()(input_ids=tokens, use_cache=False, **(packing or {}))
        return out.last_hidden_state

    @torch.no_grad()
    def _head_matches_model(self) -> bool:
        """Whether decoder + ``head_logits`` give the model's logits (true of Llama/Qwen/
        Mistral/Gemma-style models); else training takes the logits from the whole model."""
        tokens = torch.tensor([[1, 2, 3]], device=self.device) % self.vocab_size
        try:
            split = self.head_logits(self._hidden_states(tokens)).float()
        except Exception as e:  # noqa: BLE001 - any failure means: use the whole model
            log.warning("logprobs from the whole model's logits (%s)", e)
            return False
        whole = self.model(input_ids=tokens).logits.float()
        # Loose enough for bf16 kernels that differ by shape, tight enough to catch a missing
        # scale or cap (the whole model's logits are the fallback, never a wrong answer).
        if split.shape != whole.shape:
            return False
        return bool(torch.allclose(split, whole, atol=1e-3, rtol=1e-2))

    @torch.no_grad()
    def _prefix_sharing_matches(self) -> bool:
        """Whether ``_shared_logprobs`` gives the plain forward's logprobs here (a model or
        transformers version that handles a cache or a 4D mask otherwise falls back)."""
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab_size, (3, 12), generator=gen).to(self.device)
        tokens[1, :8] = tokens[0, :8]
        lengths = torch.tensor([12, 10, 9], device=self.device)
        targets = tokens.roll(-1, 1)
        mask = torch.arange(12, device=self.device) < lengths[:, None]
        try:
            shared = self._shared_logprobs(tokens, lengths, targets, [(0, 7), (0, 7), (-1, 0)])
        except Exception as e:  # noqa: BLE001 - any failure means: the plain forward only
            log.warning("shared prefixes off: %s", e)
            return False
        plain = logprobs.target_logprobs(
            self._hidden_states(tokens)[mask], self.head_logits, targets[mask], None, False
        )
        # Loose enough for bf16 kernels that differ by shape (SmolLM2 on random tokens: up to
        # 0.14 on logprobs of -10 to -20, between rows run alone and together); a wrong mask
        # or position is far outside it.
        ok = bool(torch.allclose(shared, plain, atol=0.05, rtol=0.02))
        if not ok:
            log.warning("shared prefixes off: the two-pass forward differs from the plain one")
        return ok

    def forward_backward(
        self,
        model_id: str,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None = None,
        forward_only: bool = False,
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Run the loss over ``data`` in one forward (+ one backward) pass per micro-batch.

        Losses are sums over tokens, so micro-batches accumulate exactly; the gradients stay on
        the adapter until ``optim_step``. A non-finite loss or gradient changes nothing.
        """
        spec = losses.LOSSES.get(loss_fn)
        if spec is None:
            raise UserError(losses.unknown_loss_message(loss_fn))
        head = self._require(model_id).value_head
        try:
            if head is not None:  # a critic: values through its head, loss ppo_critic
                spec, config = (
                    losses.LOSSES["ppo_critic"],
                    self._critic_config(loss_fn, loss_fn_config or {}, forward_only),
                )
            elif loss_fn == "ppo_critic":
                raise ValueError("loss_fn: 'ppo_critic' trains a critic (model_role 'critic')")
            else:
                config = spec.resolve_config(loss_fn_config or {})
        except ValueError as e:
            raise UserError(str(e)) from None
        module = self._activate(model_id)
        adapter = self.adapters[model_id]
        params = adapter.params
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total_loss = 0.0
        metric_sums: dict[str, float] = {}
        mismatch: dict[str, float] = {}  # sampler vs training logprobs (losses.sampler_mismatch)
        staged = contextlib.nullcontext() if forward_only else finite.staged_gradients(params)
        with staged, torch.set_grad_enabled(not forward_only):
            for idx, shared in self._plan(data, critic=head is not None):
                batch = [data[i] for i in idx]
                logp, mask, inputs = self._target_logprobs(module, batch, spec.inputs, shared, head)
                if head is not None and not all(n in inputs for n in spec.required):
                    result = losses.LossResult(logp.sum() * 0.0, torch.zeros_like(logp))
                else:  # (a critic's forward without values and returns: only the values)
                    result = spec.fn(logp, inputs, mask, config)
                loss = float(result.loss.detach())
                finite.check_finite(loss, "the loss")
                if not forward_only:
                    result.loss.backward()
                total_loss += loss
                for key, value in result.metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + value
                if "logprobs" in spec.required:
                    for key, value in losses.sampler_mismatch(logp, inputs, mask).items():
                        merge = max if key == losses.MISMATCH_MAX else operator.add
                        mismatch[key] = merge(mismatch.get(key, 0.0), value)
                logp_np = logp.detach().float().cpu().numpy()
                elementwise = result.elementwise.detach().float().cpu().numpy()
                name = "logprobs" if head is None else "values"  # SkyRL's key for a critic
                for row, i in enumerate(idx):
                    n = len(data[i].tokens)
                    outputs[i] = {
                        name: logp_np[row, :n],
                        "elementwise_loss": elementwise[row, :n],
                    }
            finite.check_finite(total_loss, "the loss")
            for key, value in metric_sums.items():
                finite.check_finite(value, f"metric {key}")
        metrics = {"loss:sum": total_loss}
        metrics.update({f"{k}:sum": v for k, v in metric_sums.items()})
        metrics.update(mismatch)
        if not forward_only:  # the step's share, reported by optim_step
            for key, value in mismatch.items():
                merge = max if key == losses.MISMATCH_MAX else operator.add
                adapter.mismatch[key] = merge(adapter.mismatch.get(key, 0.0), value)
        return outputs, metrics

    @staticmethod
    def _critic_config(loss_fn: str, given: dict[str, float], forward_only: bool) -> dict:
        """A critic's ppo_critic config; a forward (values only) may name any loss."""
        if forward_only and loss_fn not in losses.CRITIC_LOSSES:
            return losses.LOSSES["ppo_critic"].resolve_config({})
        return losses.critic_config(loss_fn, given)

    def _plan(
        self, data: list[DatumArrays], critic: bool = False
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Micro-batches: datum indices, and per row its group's slot in the prefix pass and
        where its own part starts ((-1, 0): none; see ``shared_prefix``). A critic's rows run
        whole (its values come from every row's own hidden states)."""
        packed = any(losses.PACKING_INPUT in d.inputs for d in data)
        shareable = self.share_prefixes and not critic and not packed
        if shareable and all(d.inputs["target_tokens"].ndim == 1 for d in data):
            groups = shared_prefix.find_groups(
                [d.tokens for d in data], [d.inputs["target_tokens"] for d in data]
            )
        else:
            groups = [shared_prefix.Group((i,), 0) for i in range(len(data))]
        lengths = [len(d.tokens) for d in data]
        plan = []
        for batch in shared_prefix.microbatches(groups, lengths, self.microbatch_tokens):
            idx, spec, slot = [], [], 0
            for group in batch:
                place = (slot, group.shared) if group.shared else (-1, 0)
                idx.extend(group.rows)
                spec.extend([place] * len(group.rows))
                slot += 1 if group.shared else 0
            plan.append((idx, spec))
        return plan

    def _target_logprobs(
        self,
        module: torch.nn.Module,
        batch: list[DatumArrays],
        input_names: tuple[str, ...],
        shared: list[tuple[int, int]] | None = None,
        value_head: torch.nn.Linear | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Right-padded batch -> log p(target) [B, T] (or [B, T, K] for K targets per
        position), validity mask [B, T], loss inputs shaped like the targets. An optional
        input a datum left out gets its default (``losses.default_input``).

        Only the valid positions' logprobs are computed, from the final hidden states through
        the output layer a chunk at a time (``logprobs.py``): no [tokens, vocab] float32
        logits for the whole micro-batch; the decoder layers are checkpointed if enabled.
        ``shared``: per row, its group's slot and shared length (``_plan``); rows in groups
        run their shared part once (``_shared_logprobs``). ``value_head`` (a critic): its
        values at the same positions instead of logprobs."""
        width = max(len(d.tokens) for d in batch)
        k_shape = batch[0].inputs["target_tokens"].shape[1:]  # () or (K,)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        present = [n for n in input_names if any(n in d.inputs for d in batch)]
        inputs = {name: torch.zeros(len(batch), width, *k_shape) for name in present}
        targets = torch.zeros(len(batch), width, *k_shape, dtype=torch.long)
        for row, d in enumerate(batch):
            n = len(d.tokens)
            tokens[row, :n] = torch.from_numpy(d.tokens)
            mask[row, :n] = True
            targets[row, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
            for name in present:
                value = d.inputs.get(name)
                if value is None:
                    value = losses.default_input(name, d.inputs)
                inputs[name][row, :n] = torch.from_numpy(value.astype(np.float32))
        dev = self.device
        tokens, mask, targets = tokens.to(dev), mask.to(dev), targets.to(dev)
        inputs = {k: v.to(dev) for k, v in inputs.items()}
        targets = targets.flatten(2) if targets.dim() > 2 else targets
        packing = packed_attention(batch, width, dev)
        if value_head is not None:
            with self._checkpointing(tokens.numel()), self._keeping():
                hidden = self._hidden_states(tokens, packing)[mask]
            picked = value_head(hidden.float()).squeeze(-1)
        elif shared is not None and any(slot >= 0 for slot, _ in shared):
            with self._keeping():
                picked = self._shared_logprobs(tokens, mask.sum(1), targets, shared)
        else:
            with self._checkpointing(tokens.numel()) as recompute, self._keeping():
                if self._split_head:
                    hidden, head = self._hidden_states(tokens, packing), self.head_logits
                else:  # right-padded: see _hidden_states
                    hidden = module(input_ids=tokens, **(packing or {})).logits
                    head = _identity
                picked = logprobs.target_logprobs(
                    hidden[mask], head, targets[mask], None, recompute
                )
        logp = torch.zeros(targets.shape, dtype=torch.float32, device=dev)
        return logp.index_put((mask,), picked), mask, inputs

    def _shared_logprobs(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        targets: torch.Tensor,
        spec: list[tuple[int, int]],
    ) -> torch.Tensor:
        """log p(target) at each row's positions (row-major, as ``tokens[mask]``), with each
        group's shared part run once (``shared_prefix``).

        Two decoder calls: the groups' shared parts, right-padded, keeping their keys and
        values; then every row's own part at its true positions, attending to its group's
        keys and values (a 4D mask: its own group's shared positions, then causal). A row
        with no group (slot -1) runs whole in the second call. The output layer runs once per
        distinct position: a group's shared positions have the same targets."""
        dev = tokens.device
        rows = tokens.shape[0]
        first: dict[int, int] = {}  # slot -> its first row, whose tokens the pass runs
        for row, (slot, _) in enumerate(spec):
            if slot >= 0:
                first.setdefault(slot, row)
        shared = torch.tensor([spec[first[s]][1] for s in range(len(first))], device=dev)
        width = int(shared.max())
        prefix_rows = torch.tensor([first[s] for s in range(len(first))], device=dev)
        prefix_valid = torch.arange(width, device=dev) < shared[:, None]
        prefix = tokens[prefix_rows, :width].masked_fill(~prefix_valid, self.pad_id)
        decoder = self.model.get_decoder()
        out = decoder(input_ids=prefix, use_cache=True)
        cache = out.past_key_values
        starts = torch.tensor([start for _, start in spec], device=dev)
        own = lengths - starts
        own_width = int(own.max())
        positions = starts[:, None] + torch.arange(own_width, device=dev)  # [rows, own]
        own_valid = torch.arange(own_width, device=dev) < own[:, None]
        last = tokens.shape[1] - 1
        suffix = tokens.gather(1, positions.clamp(max=last)).masked_fill(~own_valid, self.pad_id)
        slots = torch.tensor([max(s, 0) for s, _ in spec], device=dev)  # (a lone row: any)
        cache.batch_select_indices(slots)
        sees_prefix = torch.arange(width, device=dev) < starts[:, None]  # [rows, width]
        causal = torch.ones(own_width, own_width, dtype=torch.bool, device=dev).tril()
        attend = torch.cat(
            [sees_prefix[:, None].expand(-1, own_width, -1), causal.expand(rows, -1, -1)], -1
        )[:, None]
        own_hidden = decoder(
            input_ids=suffix,
            past_key_values=cache,
            attention_mask=attend,
            position_ids=positions,
            use_cache=True,
        ).last_hidden_state
        prefix_targets = targets[prefix_rows, :width][prefix_valid]
        own_targets = targets.gather(1, positions.clamp(max=last))[own_valid]
        picked = logprobs.target_logprobs(
            torch.cat([out.last_hidden_state[prefix_valid], own_hidden[own_valid]]),
            self.head_logits,
            torch.cat([prefix_targets, own_targets]),
            None,
            False,
        )
        # Where each row's positions are in ``picked``: a shared position at its group's
        # entry, an own one at its row's.
        n_prefix = int(prefix_valid.sum())
        prefix_at = torch.zeros(prefix_valid.shape, dtype=torch.long, device=dev)
        prefix_at[prefix_valid] = torch.arange(n_prefix, device=dev)
        own_at = torch.zeros(own_valid.shape, dtype=torch.long, device=dev)
        own_at[own_valid] = n_prefix + torch.arange(int(own_valid.sum()), device=dev)
        t = torch.arange(tokens.shape[1], device=dev)[None]
        from_prefix = prefix_at[slots[:, None], t.clamp(max=width - 1)]
        from_own = own_at.gather(1, (t - starts[:, None]).clamp(0, own_width - 1))
        at = torch.where(t < starts[:, None], from_prefix, from_own)
        return picked[at[t < lengths[:, None]]]

    def optim_step(
        self,
        model_id: str,
        learning_rate: float = 1e-4,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """AdamW (torch's, decoupled weight decay) on the adapter's accumulated gradients."""
        adapter = self._require(model_id)
        for group in adapter.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        max_norm = grad_clip_norm if grad_clip_norm > 0 else math.inf
        grads = [p for p in adapter.params if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        finite.check_finite(grad_norm, "the gradient norm")
        finite.guarded_step(adapter.params, adapter.optimizer)
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        metrics = {"grad_norm:mean": grad_norm, "learning_rate:mean": learning_rate}
        metrics.update(step_mismatch(adapter.mismatch))
        adapter.mismatch = {}
        return metrics


def step_mismatch(sums: dict[str, float]) -> dict[str, float]:
    """A step's sampler/trainer agreement from its forward_backward sums: the mean and max of
    |logp_train - logp_sampler| over the sampled tokens and the share of importance ratios
    outside [0.5, 2] (the cookbook's RL loop writes optim_step's metrics to metrics.jsonl, not
    forward_backward's). Nothing when no RL loss ran since the last step; zeros when one ran
    but no token was told apart from the prompt (a converged policy's sampled tokens have
    logprob 0.0 and, their group all right, advantage 0: the prompt's marks), so an RL
    loop's every step still reports it."""
    if losses.MISMATCH_TOKENS not in sums:
        return {}
    tokens = sums[losses.MISMATCH_TOKENS]
    if not tokens:
        return {STEP_MISMATCH_MEAN: 0.0, STEP_MISMATCH_MAX: 0.0, STEP_RATIO_OUTSIDE: 0.0}
    return {
        STEP_MISMATCH_MEAN: sums[losses.MISMATCH_SUM] / tokens,
        STEP_MISMATCH_MAX: sums[losses.MISMATCH_MAX],
        STEP_RATIO_OUTSIDE: sums[losses.RATIO_OUTSIDE] / tokens,
    }


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def packed_attention(batch: list[DatumArrays], width: int, device) -> dict | None:
    """For a micro-batch with packed datums (``losses.PACKING_INPUT``): the decoder's boolean
    4D attention mask [B, 1, T, T] (causal within a segment) and position ids restarting at
    each segment; None for a batch without (the plain causal pass). A datum without segments
    is one segment."""
    if not any(losses.PACKING_INPUT in d.inputs for d in batch):
        return None
    segments = torch.full((len(batch), width), -1, dtype=torch.long)
    for row, d in enumerate(batch):
        ids = d.inputs.get(losses.PACKING_INPUT)
        n = len(d.tokens)
        segments[row, :n] = 0 if ids is None else torch.from_numpy(ids.astype(np.int64))
    segments = segments.to(device)
    position = torch.arange(width, device=device)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, position, 0).cummax(dim=1).values
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return {"attention_mask": (same & causal)[:, None], "position_ids": position - first}
