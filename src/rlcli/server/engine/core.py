"""The compute engine: one base model, many LoRA adapters, every loss in one fused pass.

``Engine`` is plain Python over transformers + peft and is usable in-process (the benchmarks
compare against it); ``process.py`` runs it in its own process behind a queue of typed
operations (``ops.py``), so the HTTP layer never waits on a forward pass. It computes only:
the training half is ``training.py`` (gradients and steps through ``finite.py``: no non-finite
value reaches an adapter), the hardware defaults ``hardware.py``, sampler weights go through
``samplers.py``, files through ``store/checkpoints.py``.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from rlcli.models.tokenizer import end_of_turn_id
from rlcli.server.engine import attention, decode_step, fused_lora, losses, precision
from rlcli.server.engine.d2l import Hypernets
from rlcli.server.engine.hardware import (
    activation_bytes_per_token,
    checkpoint_above,
    pick_device,
    pick_dtype,
    pick_microbatch_tokens,
)
from rlcli.server.engine.samplers import SamplerCache
from rlcli.server.engine.sampling import DecodeBatch, SampleJob, SampleOutput, decode_all
from rlcli.server.engine.slot_batch import SlotBatch
from rlcli.server.engine.training import Adapter, Training
from rlcli.server.errors import UserError
from rlcli.server.store import checkpoints

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
SAMPLE_ROWS_PER_BATCH = 64  # rows (prompt x sample) decoded together
# A critic's value head in its training checkpoint, beside peft's keys (none starts so).
VALUE_HEAD_KEY = "rlcli_value_head.weight"


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


class Engine(Training):
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

    def _training_state(self, name: str) -> dict[str, torch.Tensor]:
        """What a training checkpoint holds: the LoRA matrices, and a critic's value head."""
        state = self._adapter_state(name)
        head = self.adapters[name].value_head
        if head is not None:
            state[VALUE_HEAD_KEY] = head.weight.detach().to("cpu", copy=True)
        return state

    def save_state(
        self, model_id: str, directory: str, meta: dict, with_optimizer: bool = True
    ) -> dict:
        """Write the adapter (PEFT format) and, for exact resumes, its optimizer state."""
        adapter = self._require(model_id)
        version = checkpoints.write_adapter(
            directory,
            self._training_state(model_id),
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
        expected = {k: v.shape for k, v in self._training_state(model_id).items()}
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
            head = state.pop(VALUE_HEAD_KEY, None)
            if head is not None:
                adapter.value_head.weight.copy_(head)
            set_peft_model_state_dict(self.peft, state, adapter_name=model_id)
        adapter.optimizer.zero_grad(set_to_none=True)
        if optimizer:
            adapter.optimizer.load_state_dict(optim_state)
        else:
            adapter.optimizer.state.clear()
        return {"path": path, "model_id": model_id}

    def snapshot_sampler(self, model_id: str, key: str, directory: str | None, meta: dict):
        """Freeze the adapter's current weights as sampler ``key`` (and save them if named)."""
        if self._require(model_id).value_head is not None:
            raise UserError(
                f"model_id {model_id!r} is a critic: it gives values, not tokens, so it has no "
                "sampler; save_state keeps it"
            )
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
