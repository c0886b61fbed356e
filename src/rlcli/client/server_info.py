"""What a server says about itself (``get_server_capabilities``, read once) and the one-line
checks built on it: the model it serves, LoRA rank and alpha, sample length, a checkpoint it
holds. Used before a run folder exists (train), and by sample, chat and eval.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlcli.client import endpoint
from rlcli.errors import RlcliError


class Server:
    """What a server says about itself (``get_server_capabilities``), read once."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.caps = endpoint.get_json(self.base_url, "/api/v1/get_server_capabilities")

    @property
    def backend(self) -> str | None:
        return self.caps.get("backend")

    @property
    def served(self) -> list[str]:
        """The base models it says it serves (empty: it does not say)."""
        return [
            m.get("model_name")
            for m in self.caps.get("supported_models") or []
            if isinstance(m, dict) and m.get("model_name")
        ]

    def serves(self, model: str) -> bool:
        """Whether it serves ``model`` (or does not say, and may)."""
        return not self.served or any(same_model(model, s) for s in self.served)

    def check_model(self, model: str) -> None:
        served = self.served
        if self.serves(model):
            return
        raise RlcliError(
            f"--model {model}: the server at {self.base_url} serves {', '.join(served)}; "
            f"pass --model {served[0]} or start a server for this model"
        )

    def check_lora_rank(self, rank: int) -> None:
        top = self.caps.get("max_lora_rank")
        if isinstance(top, int) and rank > top:
            raise RlcliError(
                f"--lora-rank {rank}: the server at {self.base_url} allows at most {top} "
                "(rlcli serve start --max-lora-rank)"
            )

    def check_lora_alpha(self, alpha: float | None) -> None:
        """Only a server that says it takes one (rlcli's torch server) gets an alpha: the
        Tinker API has no field for it, and another server would drop it without a word."""
        if alpha is not None and not self.caps.get("lora_alpha"):
            raise RlcliError(
                f"--lora-alpha {alpha:g}: the server at {self.base_url} takes no LoRA alpha "
                "(the Tinker API has none; rlcli's torch server does); leave it out"
            )

    def check_packing(self, segment_key: str) -> None:
        """``train sl --pack`` needs a server that masks attention per packed example (rlcli's
        torch server says so in its capabilities); elsewhere examples would see each other."""
        if self.caps.get("packing") != segment_key:
            raise RlcliError(
                f"--pack: the server at {self.base_url} does not take packed examples (rlcli's "
                "torch server does); leave it out"
            )

    def check_max_tokens(self, max_tokens: int) -> None:
        top = self.caps.get("max_sample_tokens")
        if isinstance(top, int) and max_tokens > top:
            raise RlcliError(
                f"--max-tokens {max_tokens}: the server at {self.base_url} samples at most {top}"
            )

    def check_checkpoint(self, path: str | None, flag: str, kind: str) -> None:
        """A ``tinker://RUN/NAME`` checkpoint of ``kind`` ("training": weights/..., for a
        training client; "sampler": sampler_weights/..., for a sampling client) that this server
        holds (our server lists a run's checkpoints; elsewhere the recipe finds out)."""
        if not path or self.backend != "torch":
            return
        run_id, _, name = path.removeprefix("tinker://").partition("/")
        try:
            listed = endpoint.get_json(self.base_url, f"/api/v1/training_runs/{run_id}/checkpoints")
        except RlcliError:
            raise RlcliError(
                f"{flag} {path}: the server at {self.base_url} has no training run {run_id!r}"
            ) from None
        kinds = {c.get("checkpoint_id"): c.get("checkpoint_type") for c in listed["checkpoints"]}
        if name not in kinds:
            have = ", ".join(sorted(k for k in kinds if k)) or "none"
            raise RlcliError(f"{flag} {path}: no such checkpoint; that run has: {have}")
        if kinds[name] != kind:
            want = "weights/... (state)" if kind == "training" else "sampler_weights/..."
            raise RlcliError(f"{flag} {path}: a {kinds[name]} checkpoint; pass a {want} path")


def same_model(given: str, served: str) -> bool:
    if given == served:
        return True
    a, b = Path(given).expanduser(), Path(served).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def as_json(value) -> str:
    return json.dumps(value)


def server_reason(error) -> str:
    """The server's own reason from an SDK HTTP error, on one line."""
    body = getattr(error, "body", None)
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or body
        if isinstance(detail, list | dict):
            detail = as_json(detail)
        text = str(detail)
    else:
        text = str(error)
    return (
        f"refused by the server ({getattr(error, 'status_code', '?')}): "
        + " ".join(text.split())[:300]
    )
