"""The compute engine: one base model, many LoRA adapters, every loss in one fused pass.

``Engine`` is plain Python over transformers + peft and is usable in-process (the benchmarks
compare against it). ``engine_main`` runs it in its own process behind two queues, so the HTTP
layer (``app.py``) never waits on a forward pass. Requests run one at a time in arrival order,
which is the order each tinker client submits them in.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcli.server import checkpoints, losses
from rlcli.server.sampling import SampleJob, SampleOutput, generate
from rlcli.server.wire import DatumArrays

log = logging.getLogger("rlcli.engine")

LORA_ALPHA = 32  # fixed, as on Tinker: the learning rate does not have to move with the rank
# Padded tokens per forward pass: bounds activation memory (a 30-layer 135M model holds
# about 1.4 MB of activations per token for the backward pass).
MICROBATCH_TOKENS = 4096
MAX_LOADED_SAMPLERS = 8  # sampler snapshots kept as live peft adapters (LRU)
# In-memory sampler snapshots kept for reloading (oldest dropped). RL makes one per step and
# samples from it for that step only; a LoRA of a 4B model is ~250 MB in float32.
MAX_SNAPSHOTS = 16
SAMPLE_ROWS_PER_BATCH = 64  # rows (prompt x sample) decoded together


class UserError(ValueError):
    """The request was wrong (not the server): reported to the client as a user error."""


@dataclass
class Adapter:
    """A training client's LoRA: its parameters and optimizer (its config is peft's)."""

    name: str
    rank: int
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


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
        max_lora_rank: int = 64,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.base_model = base_model
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.max_lora_rank = max_lora_rank
        config = AutoConfig.from_pretrained(base_model)
        self.model = AutoModelForCausalLM.from_pretrained(base_model, dtype=self.dtype)
        self.model.to(self.device)
        self.model.eval()  # no dropout: logprobs must match between forward and sampling
        self.model.requires_grad_(False)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 0) or 32768
        self.layer_groups = lora_layer_groups(self.model)  # before peft wraps any layer
        self.peft = None  # the PeftModel, once the first adapter exists
        self.adapters: dict[str, Adapter] = {}
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(base_model)
        pad = self.tokenizer.pad_token_id
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        # Like vLLM: the end-of-sequence token always ends a sample, on top of `stop`.
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = sorted({int(e) for e in eos if e is not None})
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        # Sampler snapshots: key -> (LoraConfig, CPU state dict). Ephemeral ones (from
        # save_weights_and_get_sampling_client) live only here; saved ones also on disk.
        self.snapshots: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
        self.loaded_samplers: dict[str, str] = {}  # key -> peft adapter name, in LRU order

    # ---- adapters -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_lora_rank": self.max_lora_rank,
            "losses": sorted(losses.LOSSES),
        }

    def create_adapter(
        self,
        name: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> dict[str, Any]:
        from peft import LoraConfig, get_peft_model

        if name in self.adapters:
            raise UserError(f"model_id {name!r} already exists")
        if not 1 <= rank <= self.max_lora_rank:
            raise UserError(f"lora_config.rank: {rank} is outside 1..{self.max_lora_rank}")
        wanted = {"attn": train_attn, "mlp": train_mlp, "unembed": train_unembed}
        targets = sorted(set().union(*(self.layer_groups[g] for g, on in wanted.items() if on)))
        if not targets:
            raise UserError("lora_config: no layers selected (train_mlp/attn/unembed all off?)")
        config = LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
            if self.peft is None:
                self.peft = get_peft_model(self.model, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        params = [p for n, p in self.peft.named_parameters() if "lora_" in n and f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        self.adapters[name] = Adapter(name, rank, params, optimizer)
        return {"model_id": name, "trainable_params": sum(p.numel() for p in params)}

    def remove_adapter(self, name: str) -> dict[str, Any]:
        if self.adapters.pop(name, None) is None:
            raise UserError(f"unknown model_id {name!r}")
        if self.adapters or self.loaded_samplers:
            self.peft.delete_adapter(name)
        else:  # peft cannot delete its last adapter: unwrap back to the bare base model
            self.model = self.peft.unload()
            self.peft = None
        return {"model_id": name}

    def _set_adapter(self, name: str) -> None:
        """peft's set_adapter walks every module (~0.7 ms on the tiny model): skip repeats."""
        if self.peft.active_adapter != name:
            self.peft.set_adapter(name)

    def _activate(self, name: str | None) -> torch.nn.Module:
        """The module to run: the base model (``None``) or the base with one adapter on."""
        if name is None:
            if self.peft is None:
                return self.model
            return _BaseOnly(self.peft)
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
        the adapter until ``optim_step``.
        """
        spec = losses.LOSSES.get(loss_fn)
        if spec is None:
            raise UserError(losses.unknown_loss_message(loss_fn))
        config = spec.resolve_config(loss_fn_config or {})
        module = self._activate(model_id)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total_loss = 0.0
        metric_sums: dict[str, float] = {}
        for idx in _microbatches([len(d.tokens) for d in data], MICROBATCH_TOKENS):
            batch = [data[i] for i in idx]
            with torch.set_grad_enabled(not forward_only):
                logp, mask, inputs = self._target_logprobs(module, batch, spec.inputs)
                result = spec.fn(logp, inputs, mask, config)
                if not forward_only:
                    result.loss.backward()
            total_loss += float(result.loss.detach())
            for key, value in result.metrics.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value
            logp_np = logp.detach().float().cpu().numpy()
            elementwise = result.elementwise.detach().float().cpu().numpy()
            for row, i in enumerate(idx):
                n = len(data[i].tokens)
                outputs[i] = {
                    "logprobs": logp_np[row, :n],
                    "elementwise_loss": elementwise[row, :n],
                }
        metrics = {"loss:sum": total_loss}
        metrics.update({f"{k}:sum": v for k, v in metric_sums.items()})
        return outputs, metrics

    def _target_logprobs(
        self, module: torch.nn.Module, batch: list[DatumArrays], input_names: tuple[str, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Right-padded batch -> per-token log p(target) [B, T], validity mask, loss inputs."""
        width = max(len(d.tokens) for d in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        present = [name for name in input_names if name in batch[0].inputs]
        inputs = {name: torch.zeros(len(batch), width) for name in present}
        targets = torch.zeros(len(batch), width, dtype=torch.long)
        for row, d in enumerate(batch):
            n = len(d.tokens)
            tokens[row, :n] = torch.from_numpy(d.tokens)
            mask[row, :n] = True
            targets[row, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
            for name in present:
                inputs[name][row, :n] = torch.from_numpy(d.inputs[name].astype(np.float32))
        dev = self.device
        tokens, mask, targets = tokens.to(dev), mask.to(dev), targets.to(dev)
        inputs = {k: v.to(dev) for k, v in inputs.items()}
        logits = module(input_ids=tokens, attention_mask=mask.long()).logits.float()
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        return logp * mask, mask, inputs

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
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise UserError(f"unknown model_id {model_id!r}")
        for group in adapter.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        max_norm = grad_clip_norm if grad_clip_norm > 0 else math.inf
        grads = [p for p in adapter.params if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": learning_rate}

    # ---- checkpoints -----------------------------------------------------------------------
    def _adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        from peft.utils import get_peft_model_state_dict

        # Only the LoRA matrices: with tied embeddings peft would otherwise add the whole
        # (frozen) embedding matrix to every checkpoint and sampler snapshot.
        state = get_peft_model_state_dict(self.peft, adapter_name=name, save_embedding_layers=False)
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def save_state(self, model_id: str, directory: str, meta: dict) -> dict:
        """Write the adapter (PEFT format) and its optimizer state, for exact resumes."""
        adapter = self._require(model_id)
        checkpoints.write_adapter(
            directory,
            self._adapter_state(model_id),
            self.peft.peft_config[model_id],
            self.base_model,
            optimizer=adapter.optimizer.state_dict(),
            meta={**meta, "steps": adapter.steps},
        )
        return {"path": meta["tinker_path"]}

    def load_state(self, model_id: str, directory: str, optimizer: bool, path: str) -> dict:
        from peft.utils import set_peft_model_state_dict

        adapter = self._require(model_id)
        config, state, optim_state = checkpoints.read_adapter(directory, optimizer)
        if config.r != adapter.rank:
            raise UserError(
                f"path: {path} has LoRA rank {config.r}, this training client has {adapter.rank}"
            )
        with torch.no_grad():
            set_peft_model_state_dict(self.peft, state, adapter_name=model_id)
        adapter.optimizer.zero_grad(set_to_none=True)
        if optimizer:
            if optim_state is None:
                raise UserError(f"path: {path} holds no optimizer state (a sampler checkpoint?)")
            adapter.optimizer.load_state_dict(optim_state)
        else:
            adapter.optimizer.state.clear()
        return {"path": path, "model_id": model_id}

    def snapshot_sampler(self, model_id: str, key: str, directory: str | None, meta: dict):
        """Freeze the adapter's current weights as sampler ``key`` (and save them if named)."""
        self._require(model_id)
        state = self._adapter_state(model_id)
        config = self.peft.peft_config[model_id]
        if directory:
            checkpoints.write_adapter(directory, state, config, self.base_model, meta=meta)
        self.snapshots[key] = (config, state)
        while len(self.snapshots) > MAX_SNAPSHOTS:
            oldest = next(iter(self.snapshots))
            self.snapshots.pop(oldest)
            self._unload_sampler(oldest)
        return {"path": meta.get("tinker_path"), "key": key}

    def _unload_sampler(self, key: str) -> None:
        name = self.loaded_samplers.pop(key, None)
        if name is not None:
            self.peft.delete_adapter(name)

    def _sampler_module(self, key: str | None) -> torch.nn.Module:
        """The module that samples from ``key``: the base model, or a snapshot as an adapter,
        loaded on demand from memory or from its checkpoint folder."""
        from peft import get_peft_model
        from peft.utils import set_peft_model_state_dict

        if key is None:
            return self._activate(None)
        if key in self.loaded_samplers:
            name = self.loaded_samplers.pop(key)
            self.loaded_samplers[key] = name  # most recently used
            self._set_adapter(name)
            return self.peft
        if key not in self.snapshots:
            if not key.startswith("/"):
                raise UserError("sampler expired: save the weights for sampling again")
            config, state, _ = checkpoints.read_adapter(key, optimizer=False)
            self.snapshots[key] = (config, state)
        config, state = self.snapshots[key]
        config = copy.deepcopy(config)  # peft keeps (and may change) the config it is given
        while len(self.loaded_samplers) >= MAX_LOADED_SAMPLERS:
            self._unload_sampler(next(iter(self.loaded_samplers)))
        name = f"sampler-{len(self.loaded_samplers)}-{time.monotonic_ns()}"
        if self.peft is None:
            self.peft = get_peft_model(self.model, config, adapter_name=name)
        else:
            self.peft.add_adapter(name, config)
        with torch.no_grad():
            set_peft_model_state_dict(self.peft, state, adapter_name=name)
        for n, p in self.peft.named_parameters():
            if f".{name}." in n:
                p.requires_grad_(False)
        self.loaded_samplers[key] = name
        self._set_adapter(name)
        return self.peft

    # ---- sampling ---------------------------------------------------------------------------
    def sample(self, jobs: list[SampleJob]) -> list[SampleOutput | str]:
        """Run many sample requests, batched per sampler. A job that fails (an expired sampler)
        gets its error message in place of an output; the others still run."""
        results: list[SampleOutput | str] = [""] * len(jobs)
        groups: dict[str | None, list[int]] = {}
        for i, job in enumerate(jobs):
            job.stop_tokens = sorted(set(job.stop_tokens) | set(self.eos_ids))
            groups.setdefault(job.sampler, []).append(i)
        for key, indices in groups.items():
            try:
                module = self._sampler_module(key)
            except UserError as e:
                for i in indices:
                    results[i] = str(e)
                continue
            for chunk in _row_chunks([jobs[i] for i in indices], indices):
                outs = generate(
                    module,
                    [jobs[i] for i in chunk],
                    device=self.device,
                    pad_id=self.pad_id,
                    decode=self.tokenizer.decode,
                )
                for i, out in zip(chunk, outs, strict=True):
                    results[i] = out
        return results

    def _require(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise UserError(f"unknown model_id {model_id!r}")
        return adapter


class _BaseOnly(torch.nn.Module):
    """Runs a PeftModel with every adapter disabled: the plain base model."""

    def __init__(self, peft_model) -> None:
        super().__init__()
        self.peft_model = peft_model

    def forward(self, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(**kwargs)


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


def _microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group datum indices so each group's padded size (rows x longest) stays within budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * width > budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


# ---- the engine process ------------------------------------------------------------------


def engine_main(settings: dict[str, Any], requests, results) -> None:
    """Process entry point: build the engine, then serve ``(request_id, op, kwargs)`` forever.

    Replies are ``(request_id, "ok", value)`` or ``(request_id, "user"|"server", message)``.
    The first reply is ``("__ready__", "ok", info)`` or ``("__ready__", "server", why)``.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    torch.set_num_threads(settings.get("threads") or torch.get_num_threads())
    try:
        engine = Engine(
            settings["base_model"],
            device=settings.get("device", "auto"),
            dtype=settings.get("dtype", "auto"),
            max_lora_rank=settings.get("max_lora_rank", 64),
        )
    except Exception as e:
        log.error("engine failed to start:\n%s", traceback.format_exc())
        results.put(("__ready__", "server", f"{type(e).__name__}: {e}"))
        return
    results.put(("__ready__", "ok", engine.info()))
    log.info("engine ready: %s", engine.info())
    parent = os.getppid()
    held = None  # a non-sample request met while gathering a sampling batch
    while True:
        if held is not None:
            item, held = held, None
        else:
            try:
                item = requests.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the HTTP process died without telling us
                    return
                continue
        if item is None:
            return
        if item[1] == "sample":
            batch, held = _gather_samples(item, requests)
            _run_samples(engine, batch, results)
            continue
        _run_one(engine, item, results)


def _gather_samples(first, requests, window: float = 0.003):
    """The sample requests queued right behind ``first`` (waiting ``window`` s for
    stragglers), so concurrent rollouts decode as one batch. Stops at the first request of
    another kind, which is returned to run next: order across kinds is kept."""
    batch, deadline = [first], time.monotonic() + window
    while len(batch) < SAMPLE_ROWS_PER_BATCH:
        try:
            item = requests.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if item is None or item[1] != "sample":
            return batch, item
        batch.append(item)
    return batch, None


def _run_samples(engine: Engine, batch, results) -> None:
    try:
        outputs = engine.sample([kwargs["job"] for _, _, kwargs in batch])
    except Exception as e:
        log.error("sample failed:\n%s", traceback.format_exc())
        for request_id, _, _ in batch:
            results.put((request_id, "server", f"{type(e).__name__}: {e}"))
        return
    for (request_id, _, _), out in zip(batch, outputs, strict=True):
        results.put((request_id, "user", out) if isinstance(out, str) else (request_id, "ok", out))


def _run_one(engine: Engine, item, results) -> None:
    request_id, op, kwargs = item
    started = time.perf_counter()
    try:
        results.put((request_id, "ok", getattr(engine, op)(**kwargs)))
    except UserError as e:
        results.put((request_id, "user", str(e)))
    except Exception as e:
        log.error("%s failed:\n%s", op, traceback.format_exc())
        results.put((request_id, "server", f"{type(e).__name__}: {e}"))
    log.debug("%s %s took %.3fs", op, request_id, time.perf_counter() - started)
