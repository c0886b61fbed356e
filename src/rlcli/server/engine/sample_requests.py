"""The engine's sampling half: sample requests batched per sampler, the decode batch that runs
them, and a sampler's LoRA as our decode step takes it.

``SampleRequests`` is a part of ``core.Engine`` (which inherits it), kept apart so the sampling
path reads on its own: a batch runs on our decode step (``slot_batch.SlotBatch``) when the step
can apply the sampler's LoRA, else on transformers' forward (``sampling.DecodeBatch``); a job
that fails alone never fails the others. The continuous batching over these entry points is
``batcher.py``'s.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlcli.server.engine import decode_step
from rlcli.server.engine.samplers import SamplerCache
from rlcli.server.engine.sampling import DecodeBatch, SampleJob, SampleOutput, decode_all
from rlcli.server.engine.slot_batch import SlotBatch
from rlcli.server.errors import UserError

log = logging.getLogger("rlcli.engine")

SAMPLE_ROWS_PER_BATCH = 64  # rows (prompt x sample) decoded together


class SampleRequests:
    """``Engine``'s sample and decode_batch (the attributes below are the Engine's)."""

    model: torch.nn.Module
    device: torch.device
    peft: Any
    pad_id: int
    eos_ids: list[int]
    max_context: int
    tokenizer: Any
    decoder: decode_step.Compiled | None
    samplers: SamplerCache
    _lora_support: dict[str, bool]
    _sampler_slots: dict[str, str]

    def _sampler_module(self, key: str | None) -> torch.nn.Module:
        """The module that samples from ``key``: the base model, or a snapshot as an adapter."""
        return self._prefill_module(key)[0]

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
