"""The compute engine: one base model, many LoRA adapters, every loss in one fused pass.

``Engine`` is plain Python over transformers + peft and is usable in-process (the benchmarks
compare against it); ``engine_process.py`` runs it in its own process behind a queue of typed
operations (``ops.py``), so the HTTP layer never waits on a forward pass. It computes only:
gradients and steps go through ``finite.py`` (no non-finite value reaches an adapter), sampler
weights through ``samplers.py``, files through ``checkpoints.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlcli.models.tokenizer import end_of_turn_id
from rlcli.server import (
    attention,
    checkpoints,
    decode_step,
    finite,
    fused_lora,
    logprobs,
    losses,
    precision,
    shared_prefix,
)
from rlcli.server.errors import UserError
from rlcli.server.samplers import SamplerCache
from rlcli.server.sampling import DecodeBatch, SampleJob, SampleOutput, decode_all
from rlcli.server.slot_batch import SlotBatch
from rlcli.server.wire import DatumArrays

log = logging.getLogger("rlcli.engine")

# As on Tinker, unless a client asks for another (rlcli's --lora-alpha): with it fixed, the
# learning rate does not have to move with the rank
LORA_ALPHA = 32
# Padded tokens per forward/backward pass: bounds activation memory (a 30-layer 135M model
# holds about 2.7 MB per token for the backward pass without gradient checkpointing, about
# 0.1 MB with it). A GPU checkpoints and takes the ceiling; a CPU does not checkpoint and takes
# the floor in float32, in bf16 what half its free memory holds (pick_microbatch_tokens).
MICROBATCH_TOKENS = 4096  # the default's ceiling
MIN_CPU_MICROBATCH_TOKENS = 512  # the CPU default's floor: an RL prompt and a 256-token answer
MAX_LOADED_SAMPLERS = 8  # sampler snapshots kept as live peft adapters (LRU)
# Peft adapters of unloaded samplers kept to refill with new snapshots (_add_sampler_adapter).
SPARE_SAMPLER_SLOTS = 4
# In-memory sampler snapshots kept for reloading. RL makes one per step and samples from it
# for that step (async RL: a step or two back); a LoRA of a 4B model is ~250 MB in float32.
# Each training client's newest SNAPSHOTS_PER_CLIENT, and any it sampled since its last save,
# are kept (samplers.py); the others share an LRU of MAX_SNAPSHOTS.
MAX_SNAPSHOTS = 16
SNAPSHOTS_PER_CLIENT = 2
SAMPLE_ROWS_PER_BATCH = 64  # rows (prompt x sample) decoded together
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
    # sampler/trainer mismatch summed over the forward_backward calls since the last step
    mismatch: dict[str, float] = field(default_factory=dict)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The base weights' dtype, which is the compute dtype of training and sampling alike.

    ``auto`` is bfloat16 where the hardware computes in it (a CUDA device with bf16, a CPU with
    AVX512-BF16 or AMX) and float32 elsewhere: on an AVX2-only CPU bf16 matmuls are emulated
    and ~6x slower than float32. LoRA weights and optimizer state stay float32 (peft's
    ``autocast_adapter_dtype``), and so does everything but the base weights' matmuls
    (``precision.py``)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def pick_microbatch_tokens(
    tokens: int | None,
    device: torch.device,
    token_bytes: int = 0,
    spare_bytes: int = 0,
    dtype: torch.dtype = torch.float32,
) -> int:
    """``--microbatch-tokens``, or the device's default.

    A GPU: ``MICROBATCH_TOKENS``, every micro-batch checkpointed (``checkpoint_above``). A
    CPU does not checkpoint. In bf16 it takes the most tokens, up to ``MICROBATCH_TOKENS`` in
    steps of 512, whose activations (``token_bytes`` each, ``activation_bytes_per_token``)
    fit in half of ``spare_bytes`` (memory free with the model loaded), and at least
    ``MIN_CPU_MICROBATCH_TOKENS``: AMX's bf16 matmuls run much faster with more rows
    (SmolLM2, a forward_backward of 8 RL rows of ~310 tokens: 11.8 s in micro-batches of 512
    tokens, 8.2 s of 2048, 7.2-7.5 s of 4096, at 3.0, 6.5 and 8.0 GB). In float32 it takes
    ``MIN_CPU_MICROBATCH_TOKENS``: there 4096 gained ~1.1x (13.2 vs 11.8 s) for twice the
    memory."""
    if tokens is not None:
        if tokens < 1:
            raise ValueError(f"microbatch_tokens must be at least 1, got {tokens}")
        return tokens
    if device.type != "cpu":
        return MICROBATCH_TOKENS
    if dtype == torch.float32:
        return MIN_CPU_MICROBATCH_TOKENS
    fits = spare_bytes // 2 // max(token_bytes, 1)
    return int(min(MICROBATCH_TOKENS, max(MIN_CPU_MICROBATCH_TOKENS, fits // 512 * 512)))


def activation_bytes_per_token(config) -> int:
    """An estimate of what a training forward keeps for the backward, per token: float32
    copies of ~12 hidden-wide and ~8 MLP-wide vectors per layer (the layers' float32
    results, and peft's float32 casts of each LoRA input), and the output layer's float32
    softmax (``logprobs.py``) with room for its temporaries. Measured on SmolLM2 (30 layers,
    576 / 1536 wide, 49k vocabulary): 2.7 MB a token in bf16; this gives 2.7."""
    config = getattr(config, "text_config", None) or config
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    wide = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    return (layers * (12 * hidden + 8 * wide) + 2 * vocab) * 4


def checkpoint_above(mode: bool | None, device: torch.device, microbatch_tokens: int) -> float:
    """Padded tokens above which a micro-batch's layers are recomputed in backward.

    On (True): always (0). Off (False): never. Auto (None): always on a GPU, where memory is
    what runs out; on a CPU only for a micro-batch over the token budget (a single row longer
    than it), since there recomputing costs half again the step (a LoRA backward is about one
    forward) and small micro-batches bound memory at no cost."""
    if mode is None:
        return microbatch_tokens if device.type == "cpu" else 0
    return 0 if mode else math.inf


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (Linux ``/proc/cpuinfo`` flags; elsewhere no)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(text.split()))


def lora_layer_groups(model: torch.nn.Module) -> dict[str, set[str]]:
    """Leaf names of the Linear layers LoRA can adapt, grouped as attn / mlp / unembed.

    Found by where each layer sits, so it works for Llama/Qwen/Mistral-style names (q_proj,
    gate_proj, ...) and for any model whose blocks have 'attn'/'attention' and
    'mlp'/'feed_forward' in their paths.
    """
    groups: dict[str, set[str]] = {"attn": set(), "mlp": set(), "unembed": set()}
    output = model.get_output_embeddings()
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = path.rsplit(".", 1)[-1]
        parents = path.lower().split(".")[:-1]
        if module is output:
            groups["unembed"].add(leaf)
        elif any("attn" in p or "attention" in p for p in parents):
            groups["attn"].add(leaf)
        elif any("mlp" in p or "feed_forward" in p for p in parents):
            groups["mlp"].add(leaf)
    return groups


class Engine:
    def __init__(
        self,
        base_model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        grad_checkpointing: bool | None = None,
        microbatch_tokens: int | None = None,
        max_lora_rank: int = 64,
        compile: bool | None = None,
    ) -> None:
        """``compile``: compile the decode step (None: ``decode_step.compile_wanted``'s
        default, on a GPU only)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        self.base_model = base_model
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.max_lora_rank = max_lora_rank
        config = AutoConfig.from_pretrained(base_model)
        self.model = AutoModelForCausalLM.from_pretrained(base_model, dtype=self.dtype)
        self.model.to(self.device)
        self.microbatch_tokens = pick_microbatch_tokens(
            microbatch_tokens,
            self.device,
            activation_bytes_per_token(config),
            decode_step.spare_memory() if self.device.type == "cpu" else 0,
            self.dtype,
        )
        self.model.requires_grad_(False)
        # bf16 matmuls, float32 results: a LoRA update is not rounded away (precision.py)
        precision.mixed_precision(self.model)
        if self.device.type == "cpu":
            attention.use_grouped_sdpa(self.model)
        self._checkpoint_above = checkpoint_above(
            grad_checkpointing, self.device, self.microbatch_tokens
        )
        self._checkpoint_layers = (
            self._enable_checkpointing() if self._checkpoint_above < math.inf else []
        )
        self.grad_checkpointing = bool(self._checkpoint_layers)  # for some micro-batches
        self.model.eval()  # no dropout: logprobs must match between forward and sampling
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self._split_head = self._head_matches_model()
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 0) or 32768
        self.layer_groups = lora_layer_groups(self.model)  # before peft wraps any layer
        # Our own decode step where the architecture allows it (before peft wraps a layer:
        # it fuses the base projections' weights in place), else transformers' forward.
        self.decoder: decode_step.Compiled | None = None
        self.decode_path = "transformers"
        why = decode_step.unsupported(self.model)
        if why is None:
            step = decode_step.LlamaStep(self.model, self.max_context)
            wanted = decode_step.compile_wanted(compile, self.device)
            self.decoder = decode_step.Compiled(step, wanted)
            self.decode_path = "rlcli llama step"
        else:
            log.info("decode step: transformers' forward for this model (%s)", why)
        self._lora_support: dict[str, bool] = {}  # sampler adapter -> the step can apply it
        self._sampler_slots: dict[str, str] = {}  # sampler adapter -> the peft adapter holding it
        self._spare_slots: list[str] = []  # peft adapters of unloaded samplers, to refill
        self.peft = None  # the PeftModel, once the first adapter exists
        self._adapters_off = False  # every LoRA layer switched off: the peft model is the base
        self.adapters: dict[str, Adapter] = {}
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(base_model)
        pad = self.tokenizer.pad_token_id
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        # Like vLLM: the end-of-sequence token always ends a sample, on top of `stop`; so does
        # the chat template's end of turn (a folder whose configs disagree still stops there).
        eos = [*(eos if isinstance(eos, list) else [eos]), end_of_turn_id(self.tokenizer)]
        self.eos_ids = sorted({int(e) for e in eos if e is not None})
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        # Rows that begin alike run their common part once (shared_prefix.py): for the models
        # our decode step knows (full attention everywhere: its 4D mask has no sliding
        # window), not where layers are checkpointed (transformers drops a checkpointed
        # layer's cache), and only where the two-pass forward gives the plain forward's
        # logprobs on this model.
        self.share_prefixes = (
            why is None
            and self._split_head
            and self._checkpoint_above >= self.microbatch_tokens
            and self._prefix_sharing_matches()
        )
        self.samplers = SamplerCache(
            self._add_sampler_adapter,
            self._delete_adapter,
            MAX_SNAPSHOTS,
            MAX_LOADED_SAMPLERS,
            SNAPSHOTS_PER_CLIENT,
        )

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

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits, as the model's own forward computes them (the output
        layer, with its LoRA if one is active, in the model's dtype; then a logit soft-cap if
        the architecture has one)."""
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's output for right-padded rows. No attention mask: causality alone
        keeps each real position from the padding after it (a padded position's output is
        never read), and SDPA's causal kernel skips what a mask would only hide (~1.5% of a
        bf16 forward_backward of 8 RL rows, identical logprobs and gradients)."""
        out = self.model.get_decoder()(input_ids=tokens, use_cache=False)
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

    # ---- adapters -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_lora_rank": self.max_lora_rank,
            "microbatch_tokens": self.microbatch_tokens,
            "grad_checkpointing": {0: "on", math.inf: "off"}.get(
                self._checkpoint_above, f"above {self.microbatch_tokens} tokens"
            ),
            "shared_prefixes": self.share_prefixes,
            "losses": sorted(losses.LOSSES),
            "eos_ids": list(self.eos_ids),  # what ends a sample (EOS, end of turn)
            "decode_step": self.decode_path,
            **(self.decoder.info() if self.decoder is not None else {}),
        }

    def compiled_graphs(self) -> int:
        """Decode-step graphs compiled so far (the engine process re-reports its info when
        this changes, so ``/rlcli/status`` shows the compile times)."""
        return self.decoder.compiles if self.decoder is not None else 0

    def create_adapter(
        self,
        name: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        alpha: float | None = None,
    ) -> dict[str, Any]:
        from peft import LoraConfig

        if name in self.adapters:
            raise UserError(f"model_id {name!r} already exists")
        if not 1 <= rank <= self.max_lora_rank:
            raise UserError(f"lora_config.rank: {rank} is outside 1..{self.max_lora_rank}")
        wanted = {"attn": train_attn, "mlp": train_mlp, "unembed": train_unembed}
        targets = sorted(set().union(*(self.layer_groups[g] for g, on in wanted.items() if on)))
        if not targets:
            raise UserError("lora_config: no layers selected (train_mlp/attn/unembed all off?)")
        alpha = alpha or LORA_ALPHA
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
            self._add_peft_adapter(name, config)
        params = [p for n, p in self.peft.named_parameters() if "lora_" in n and f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        self.adapters[name] = Adapter(name, rank, params, optimizer)
        return {"model_id": name, "trainable_params": sum(p.numel() for p in params)}

    def remove_adapter(self, name: str) -> dict[str, Any]:
        if self.adapters.pop(name, None) is None:
            raise UserError(f"unknown model_id {name!r}")
        self._delete_adapter(name)
        self.samplers.drop_owner(name)
        return {"model_id": name}

    def _delete_adapter(self, name: str) -> None:
        """Drop a peft adapter that its owner (``adapters`` or the sampler cache) let go of;
        an unloaded sampler's is kept as a spare to refill (up to ``SPARE_SAMPLER_SLOTS``)."""
        self._lora_support.pop(name, None)
        slot = self._sampler_slots.pop(name, None)
        if slot is not None and len(self._spare_slots) < SPARE_SAMPLER_SLOTS:
            self._spare_slots.append(slot)
            return
        name = slot or name
        self._adapter_layers(on=True)
        if self.adapters or self.samplers.live_count() or self._spare_slots:
            self.peft.delete_adapter(name)
        else:  # peft cannot delete its last adapter: unwrap back to the bare base model
            self.model = self.peft.unload()
            self.peft = None

    def _add_peft_adapter(self, name: str, config) -> None:
        """A new peft adapter (training or sampler), wrapping the model on the first one."""
        from peft import get_peft_model

        if self.peft is None:
            self.peft = get_peft_model(self.model, config, adapter_name=name)
        else:
            self._adapter_layers(on=True)  # a layer added now would start on
            self.peft.add_adapter(name, config)
        fused_lora.install(self.peft)  # the LoRA term added by its own matmul

    def _add_sampler_adapter(self, name: str, config, state: dict) -> None:
        """Load sampler ``name``'s weights as a peft adapter (prefill runs through peft).

        A spare peft adapter of an unloaded sampler with the same LoRA config is refilled
        instead of adding one: peft's ``add_adapter`` builds a LoRA module per layer, 0.5-0.9
        s a snapshot on SmolLM2 at rank 32, which an RL loop paid every step."""
        from peft.utils import set_peft_model_state_dict

        # Outside inference mode even when a decode batch loads it mid-admit: peft's
        # set_adapter later marks its tensors trainable, which an inference tensor refuses.
        with torch.inference_mode(False):
            wanted = config.to_dict()
            slot = next(
                (s for s in self._spare_slots if self.peft.peft_config[s].to_dict() == wanted), None
            )
            if slot is None:
                self._add_peft_adapter(name, config)
                slot = name
            else:
                self._spare_slots.remove(slot)
            self._sampler_slots[name] = slot
            with torch.no_grad():
                set_peft_model_state_dict(self.peft, state, adapter_name=slot)
            if slot == name:
                for n, p in self.peft.named_parameters():
                    if f".{name}." in n:
                        p.requires_grad_(False)

    def _set_adapter(self, name: str) -> None:
        """Adapter ``name`` on (the layers switched on too). peft's set_adapter walks every
        module (~0.7 ms on the tiny model): skip repeats."""
        self._adapter_layers(on=True)
        name = self._sampler_slots.get(name, name)
        if self.peft.active_adapter != name:
            self.peft.set_adapter(name)

    def _adapter_layers(self, *, on: bool) -> None:
        """Switch every LoRA layer on, or off (the peft model then computes the base model),
        only when that changes: peft walks every module each way (~25 ms on SmolLM2; its
        ``disable_adapter()`` context, both ways plus a status scan, cost 49 ms a forward)."""
        if self.peft is None or on != self._adapters_off:
            return
        if on:
            self.peft.base_model.enable_adapter_layers()
        else:
            self.peft.base_model.disable_adapter_layers()
        self._adapters_off = not on

    def _activate(self, name: str | None) -> torch.nn.Module:
        """The module to run: the base model (``None``) or the base with one adapter on. The
        choice holds until the next ``_activate``/``_set_adapter``, so a decode batch pays for
        the switch once, not per step."""
        if name is None:
            if self.peft is None:
                return self.model
            self._adapter_layers(on=False)
            return self.peft
        if name not in self.adapters:
            raise UserError(f"unknown model_id {name!r}")
        self._set_adapter(name)
        return self.peft

    # ---- forward / backward ----------------------------------------------------------------
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
        try:
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
            for idx, shared in self._plan(data):
                batch = [data[i] for i in idx]
                logp, mask, inputs = self._target_logprobs(module, batch, spec.inputs, shared)
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
                for row, i in enumerate(idx):
                    n = len(data[i].tokens)
                    outputs[i] = {
                        "logprobs": logp_np[row, :n],
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

    def _plan(self, data: list[DatumArrays]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Micro-batches: datum indices, and per row its group's slot in the prefix pass and
        where its own part starts ((-1, 0): none; see ``shared_prefix``)."""
        if self.share_prefixes and all(d.inputs["target_tokens"].ndim == 1 for d in data):
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
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Right-padded batch -> log p(target) [B, T] (or [B, T, K] for K targets per
        position), validity mask [B, T], loss inputs shaped like the targets. An optional
        input a datum left out gets its default (``losses.default_input``).

        Only the valid positions' logprobs are computed, from the final hidden states through
        the output layer a chunk at a time (``logprobs.py``): no [tokens, vocab] float32
        logits for the whole micro-batch; the decoder layers are checkpointed if enabled.
        ``shared``: per row, its group's slot and shared length (``_plan``); rows in groups
        run their shared part once (``_shared_logprobs``)."""
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
        if shared is not None and any(slot >= 0 for slot, _ in shared):
            picked = self._shared_logprobs(tokens, mask.sum(1), targets, shared)
        else:
            with self._checkpointing(tokens.numel()) as recompute:
                if self._split_head:
                    hidden, head = self._hidden_states(tokens), self.head_logits
                else:
                    hidden = module(input_ids=tokens).logits  # right-padded: _hidden_states
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

    # ---- checkpoints -----------------------------------------------------------------------
    def _adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        from peft.utils import get_peft_model_state_dict

        # Only this adapter's LoRA matrices, picked by its name: peft's own filter drops only
        # the adapters its peft_config lists, and LoRA layers of sampler adapters it no longer
        # listed reached a checkpoint once (under the suite's xdist runs; cause not found),
        # which then fit no training client. Not the (frozen) embedding matrix either, which
        # peft adds with tied embeddings.
        everything = self.peft.state_dict()
        owners = {k.split(".lora_")[1].split(".")[1] for k in everything if ".lora_" in k}
        strays = owners - set(self.peft.peft_config)
        if strays:
            log.warning("peft holds LoRA tensors of adapters it does not list: %s", sorted(strays))
        tagged = f".{name}."
        full = {k: v for k, v in everything.items() if "lora_" not in k or tagged in k}
        state = get_peft_model_state_dict(
            self.peft, state_dict=full, adapter_name=name, save_embedding_layers=False
        )
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def save_state(
        self, model_id: str, directory: str, meta: dict, with_optimizer: bool = True
    ) -> dict:
        """Write the adapter (PEFT format) and, for exact resumes, its optimizer state."""
        adapter = self._require(model_id)
        version = checkpoints.write_adapter(
            directory,
            self._adapter_state(model_id),
            self.peft.peft_config[model_id],
            self.base_model,
            optimizer=adapter.optimizer.state_dict() if with_optimizer else None,
            meta={**meta, "steps": adapter.steps},
        )
        return {"path": meta["tinker_path"], "size_bytes": checkpoints.folder_size(version)}

    def load_state(self, model_id: str, directory: str, optimizer: bool, path: str) -> dict:
        """Restore a fresh training client from a checkpoint, all of it or nothing.

        Everything is checked before anything changes: the LoRA rank and target modules, every
        tensor's name and shape, and the optimizer state (loaded into a scratch optimizer)."""
        from peft.utils import set_peft_model_state_dict

        adapter = self._require(model_id)
        version = checkpoints.resolve(Path(directory))
        if version is None:
            raise UserError(f"path: no checkpoint at {path}")
        config, state, optim_state = checkpoints.read_adapter(version, optimizer)
        mine = self.peft.peft_config[model_id]
        if config.r != adapter.rank:
            raise UserError(
                f"path: {path} has LoRA rank {config.r}, this training client has {adapter.rank}"
            )
        if set(config.target_modules or ()) != set(mine.target_modules or ()):
            raise UserError(
                f"path: {path} adapts {sorted(config.target_modules or ())}, this training "
                f"client adapts {sorted(mine.target_modules or ())} (train_mlp / train_attn / "
                "train_unembed differ)"
            )
        expected = {k: v.shape for k, v in self._adapter_state(model_id).items()}
        got = {k: v.shape for k, v in state.items()}
        if expected != got:
            missing = sorted(set(expected) - set(got))[:3]
            extra = sorted(set(got) - set(expected))[:3]
            odd = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])[:3]
            raise UserError(
                f"path: {path} does not match this training client's adapter "
                f"(missing {missing}, unexpected {extra}, shape differs {odd})"
            )
        if any(not bool(torch.isfinite(v).all()) for v in state.values()):
            raise UserError(f"path: {path} holds non-finite weights; refusing to load them")
        if optimizer:
            if optim_state is None:
                raise UserError(f"path: {path} holds no optimizer state (a sampler checkpoint?)")
            scratch = torch.optim.AdamW(adapter.params)
            try:
                scratch.load_state_dict(optim_state)
            except (ValueError, KeyError, RuntimeError) as e:
                raise UserError(f"path: {path} optimizer state does not fit ({e})") from None
        with torch.no_grad():
            set_peft_model_state_dict(self.peft, state, adapter_name=model_id)
        adapter.optimizer.zero_grad(set_to_none=True)
        if optimizer:
            adapter.optimizer.load_state_dict(optim_state)
        else:
            adapter.optimizer.state.clear()
        return {"path": path, "model_id": model_id}

    def snapshot_sampler(self, model_id: str, key: str, directory: str | None, meta: dict):
        """Freeze the adapter's current weights as sampler ``key`` (and save them if named)."""
        self._require(model_id)
        state = self._adapter_state(model_id)
        config = self.peft.peft_config[model_id]
        version = None
        if directory:
            version = str(
                checkpoints.write_adapter(directory, state, config, self.base_model, meta=meta)
            )
        self.samplers.put(key, config, state, version, owner=model_id)
        return {"path": meta.get("tinker_path"), "key": key}

    def _sampler_module(self, key: str | None) -> torch.nn.Module:
        """The module that samples from ``key``: the base model, or a snapshot as an adapter."""
        return self._prefill_module(key)[0]

    # ---- sampling ---------------------------------------------------------------------------
    def sample(self, jobs: list[SampleJob]) -> list[SampleOutput | UserError | Exception]:
        """Run many sample requests, batched per sampler. Each job gets its output or its own
        error: a job that fails alone (an expired sampler, a bad value) never fails the others;
        if a whole batch fails, its jobs are retried one by one to find which."""
        results: list[Any] = [None] * len(jobs)
        groups: dict[str | None, list[int]] = {}
        for i, job in enumerate(jobs):
            self.add_stops(job)
            groups.setdefault(job.sampler, []).append(i)
        for key, indices in groups.items():
            try:
                self._sampler_module(key)
            except Exception as e:
                for i in indices:
                    results[i] = e
                continue
            for chunk in _row_chunks([jobs[i] for i in indices], indices):
                outs = self._generate(key, [jobs[i] for i in chunk])
                for i, out in zip(chunk, outs, strict=True):
                    results[i] = out
        return results

    def add_stops(self, job: SampleJob) -> SampleJob:
        """The model's EOS ids and end of turn end a sample, on top of ``stop`` (unless a
        tinker>=0.38 client sent ``stop=[]``: no stop at all)."""
        if job.stop_at_eos:
            job.stop_tokens = sorted(set(job.stop_tokens) | set(self.eos_ids))
        return job

    def decode_batch(self, key: str | None) -> DecodeBatch:
        """An empty batch that starts on sampler ``key``: nothing else may run on the engine
        until it is empty (``batcher.py`` sees to that). On our decode step (``SlotBatch``)
        requests of any sampler it ``accepts`` may join it; on transformers' forward only
        ``key``'s, which is activated now."""
        if self.decoder is not None and self._step_accepts(key):
            return SlotBatch(
                self.decoder,
                activate=self._prefill_module,
                lora_weights=self._lora_weights,
                accepts=self._step_accepts,
                max_length=self.max_context,
                device=self.device,
                pad_id=self.pad_id,
                decode=self.tokenizer.decode,
            )
        module = self._sampler_module(key)
        batch = DecodeBatch(
            module, device=self.device, pad_id=self.pad_id, decode=self.tokenizer.decode
        )
        batch.key = key
        return batch

    def _prefill_module(self, key: str | None) -> tuple[torch.nn.Module, str | None]:
        """The module that prefills for sampler ``key`` and the name its adapter was loaded
        under (None: the base model)."""
        if key is None:
            return self._activate(None), None
        name = self.samplers.activate(key)
        self._set_adapter(name)
        return self.peft, name

    def _step_accepts(self, key: str | None) -> bool:
        """Whether the decode step can sample ``key``: the base, or a plain LoRA on the
        projections it knows (no DoRA, no LoRA bias, no embedding or extra modules). A key
        that fails to load is accepted: its request gets the error when it is prefilled."""
        if key is None:
            return True
        try:
            name = self.samplers.activate(key)
        except Exception:  # noqa: BLE001 - answered at prefill
            return True
        if name not in self._lora_support:
            self._lora_support[name] = self._plain_lora(name)
            if not self._lora_support[name]:
                log.info("sampler %s: its LoRA needs transformers' forward", key)
        return self._lora_support[name]

    def _plain_lora(self, name: str) -> bool:
        from peft.tuners.lora import LoraLayer

        name = self._sampler_slots.get(name, name)  # the peft adapter
        config = self.peft.peft_config[name]
        if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False):
            return False
        if getattr(config, "modules_to_save", None):
            return False
        layers = [
            m for m in self.peft.modules()
            if isinstance(m, LoraLayer)
            and (name in m.lora_A or name in getattr(m, "lora_embedding_A", {}))
        ]  # fmt: skip
        return len(layers) == len(self._lora_layers(name))

    def _lora_layers(self, name: str) -> dict:
        """Peft adapter ``name``'s LoRA layers the decode step knows: {(layer, projection) or
        "lm_head": the LoraLayer}."""
        from peft.tuners.lora import LoraLayer

        modules = {
            (i, proj): getattr(layer.self_attn if proj in decode_step.ATTN else layer.mlp, proj)
            for i, layer in enumerate(self.model.model.layers)
            for proj in decode_step.PROJECTIONS
        }
        modules[decode_step.HEAD] = self.model.get_output_embeddings()
        return {
            where: m for where, m in modules.items()
            if isinstance(m, LoraLayer) and name in m.lora_A
        }  # fmt: skip

    def _lora_weights(self, name: str) -> dict:
        """Peft adapter ``name``'s LoRA as the decode step takes it: {(layer, projection) or
        "lm_head": (A [r, in], B [out, r] x scaling)}, float32 copies (the adapter may be
        unloaded while rows still decode with it)."""
        name = self._sampler_slots.get(name, name)  # the peft adapter
        return {
            where: (
                m.lora_A[name].weight.detach().float().clone(),
                m.lora_B[name].weight.detach().float() * m.scaling[name],
            )
            for where, m in self._lora_layers(name).items()
        }

    def _generate(self, key: str | None, jobs: list[SampleJob]) -> list[SampleOutput | Exception]:
        try:
            return decode_all(self.decode_batch(key), jobs)
        except Exception as e:
            if len(jobs) == 1:
                log.exception("sampling failed")
                return [e]
        out: list[SampleOutput | Exception] = []
        for job in jobs:  # isolate the culprit: the others still get their samples
            out.extend(self._generate(key, [job]))
        return out

    def _require(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise UserError(f"unknown model_id {model_id!r}")
        return adapter


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


def _row_chunks(jobs: list[SampleJob], indices: list[int]) -> list[list[int]]:
    """Split jobs into batches of at most SAMPLE_ROWS_PER_BATCH rows (a job is never split)."""
    chunks: list[list[int]] = [[]]
    rows = 0
    for job, i in zip(jobs, indices, strict=True):
        if chunks[-1] and rows + job.num_samples > SAMPLE_ROWS_PER_BATCH:
            chunks.append([])
            rows = 0
        chunks[-1].append(i)
        rows += job.num_samples
    return chunks
