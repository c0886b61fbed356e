"""The engine's checkpoint half: an adapter's weights out (a training state with its optimizer,
a sampler snapshot) and back in, all or nothing.

``AdapterStates`` is a part of ``core.Engine`` (which inherits it), kept apart so what a
checkpoint holds reads on its own: only the adapter's own LoRA matrices (and a critic's value
head), checked name by name and shape by shape before a load changes anything. The files
themselves are ``store/checkpoints.py``'s; sampler snapshots go to ``samplers.py``'s cache.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rlcli.server.engine.samplers import SamplerCache
from rlcli.server.engine.training import Adapter
from rlcli.server.errors import UserError
from rlcli.server.store import checkpoints

log = logging.getLogger("rlcli.engine")

# A critic's value head in its training checkpoint, beside peft's keys (none starts so).
VALUE_HEAD_KEY = "rlcli_value_head.weight"


class AdapterStates:
    """``Engine``'s save_state, load_state and snapshot_sampler (the attributes below are the
    Engine's)."""

    base_model: str
    peft: Any
    adapters: dict[str, Adapter]
    samplers: SamplerCache

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
