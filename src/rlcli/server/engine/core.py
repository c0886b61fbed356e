"""The compute engine: one base model, many LoRA adapters, every loss in one fused pass.

``Engine`` is plain Python over transformers + peft and is usable in-process (the benchmarks
compare against it); ``process.py`` runs it in its own process behind a queue of typed
operations (``ops.py``), so the HTTP layer never waits on a forward pass. It computes only.
This module loads the model and keeps the adapters (training clients' LoRAs, sampler
snapshots as peft adapters, which one is on); the rest of ``Engine`` is in parts of their own:
the training half ``training.py`` (gradients and steps through ``finite.py``: no non-finite
value reaches an adapter), the sampling half ``sample_requests.py``, checkpoints in and out
``adapter_states.py``. The hardware defaults are ``hardware.py``, sampler weights go through
``samplers.py``, files through ``store/checkpoints.py``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from rlcli.models.tokenizer import end_of_turn_id
from rlcli.server.engine import attention, decode_step, fused_lora, losses, precision
from rlcli.server.engine.adapter_states import AdapterStates
from rlcli.server.engine.d2l import Hypernets
from rlcli.server.engine.hardware import (
    checkpoint_above,
    pick_device,
    pick_dtype,
    pick_microbatch_tokens,
)
from rlcli.server.engine.sample_requests import SampleRequests
from rlcli.server.engine.samplers import SamplerCache
from rlcli.server.engine.training import Adapter, Training
from rlcli.server.errors import UserError

log = logging.getLogger("rlcli.engine")

# As on Tinker, unless a client asks for another (rlcli's --lora-alpha): with it fixed, the
# learning rate does not have to move with the rank
LORA_ALPHA = 32
MAX_LOADED_SAMPLERS = 8  # sampler snapshots kept as live peft adapters (LRU)
# Peft adapters of unloaded samplers kept to refill with new snapshots (_add_sampler_adapter).
SPARE_SAMPLER_SLOTS = 4
# In-memory sampler snapshots kept for reloading. RL makes one per step and samples from it
# for that step (async RL: a step or two back); a LoRA of a 4B model is ~250 MB in float32.
# Each training client's newest SNAPSHOTS_PER_CLIENT, and any it sampled since its last save,
# are kept (samplers.py); the others share an LRU of MAX_SNAPSHOTS.
MAX_SNAPSHOTS = 16
SNAPSHOTS_PER_CLIENT = 2


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


class Engine(Training, AdapterStates, SampleRequests):
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
        self.microbatch_tokens = pick_microbatch_tokens(microbatch_tokens, self.device)
        self.model.requires_grad_(False)
        # bf16 matmuls, float32 results: a LoRA update is not rounded away (precision.py)
        precision.mixed_precision(self.model)
        # a bf16 CPU engine keeps bf16 copies of what its backward reads; attention's own
        # inputs stay float32, which the grouped attention sees to (activations.py)
        self._compact_activations = (
            self.device.type == "cpu"
            and attention.use_grouped_sdpa(self.model)
            and self.dtype == torch.bfloat16
        )
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
        self.hypernets = Hypernets(self)  # doc-to-LoRA hypernetworks on this base (d2l.py)

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
        critic: bool = False,
    ) -> dict[str, Any]:
        """A training client's LoRA and AdamW. ``critic``: plus a value head (SkyRL's critic:
        a bias-free float32 ``Linear(hidden, 1)`` on the final hidden states, initialised
        normal with std 1/(hidden+1)), trained with ppo_critic; its forward gives values."""
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
        value_head = None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
            self._add_peft_adapter(name, config)
            if critic:
                hidden = int(self.model.get_output_embeddings().weight.shape[1])
                value_head = torch.nn.Linear(hidden, 1, bias=False, device=self.device)
                torch.nn.init.normal_(value_head.weight, std=1 / (hidden + 1))
        params = [p for n, p in self.peft.named_parameters() if "lora_" in n and f".{name}." in n]
        if value_head is not None:
            params.append(value_head.weight)
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        self.adapters[name] = Adapter(name, rank, params, optimizer, value_head=value_head)
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

    def _require(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise UserError(f"unknown model_id {model_id!r}")
        return adapter
