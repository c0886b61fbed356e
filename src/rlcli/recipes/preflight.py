"""Checks a train command makes before it creates a run folder or samples a rollout.

Without a server (also for ``--dry-run``): the model argument (a path that is not there), the
renderer name. With one (``Server``): that it serves the model, the LoRA rank against its
``max_lora_rank``, and ``--loss-config`` keys (from its ``loss_fn_config`` table) and values
(a one-datum ``forward`` with the config, which the server validates). Servers that do not
publish these (SkyRL) skip what they do not say; their refusals still come before any rollout.
Every failure is one line naming the flag.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from functools import cache
from pathlib import Path

from rlcli.errors import RlcliError

# A --model that starts like a path is a path, not a hub id.
_PATH_PREFIXES = ("/", "./", "../", "~")


def check_model_arg(model: str) -> None:
    """A local model folder must exist and hold a model; a ``.gguf`` file passes (it is
    converted into a folder, see ``gguf.local_model``); hub ids pass (the server decides)."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise RlcliError(f"--model {model}: no such GGUF file")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RlcliError(f"--model {model}: no config.json in that folder")
        return
    if path.exists():
        raise RlcliError(f"--model {model}: not a folder (a hub id or a model folder)")
    if model.startswith(_PATH_PREFIXES) or model.count("/") > 1:
        raise RlcliError(f"--model {model}: no such folder")


def check_run_dir(run_dir: Path) -> None:
    """``--log-path`` must be a folder, or creatable: its nearest existing parent is a
    writable folder."""
    if run_dir.exists():
        if not run_dir.is_dir():
            raise RlcliError(f"--log-path {run_dir}: exists and is not a folder")
        return
    parent = next(p for p in run_dir.parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise RlcliError(f"--log-path {run_dir}: cannot create it ({parent} is not writable)")


@cache
def renderer_names() -> tuple[str, ...]:
    """The renderer names the pinned cookbook's ``get_renderer`` knows: its ``name == "..."``
    branches and whatever was registered (tests/test_options.py guards the parse)."""
    from tinker_cookbook import renderers

    from rlcli.compat.renderers import register

    register()  # rlcli's chat_template
    source = inspect.getsource(renderers.get_renderer)
    built_in = re.findall(r'\bname == "([\w.]+)"', source)
    return tuple(dict.fromkeys([*built_in, *renderers.get_registered_renderer_names()]))


def check_renderer(name: str | None) -> None:
    if name is None:
        return
    names = renderer_names()
    if name in names:
        return
    near = difflib.get_close_matches(name, names, n=3)
    hint = f"did you mean {' or '.join(near)}?" if near else f"known: {', '.join(names)}"
    raise RlcliError(f"--renderer {name}: not a renderer the cookbook knows; {hint}")


class Server:
    """What a server says about itself (``get_server_capabilities``), read once."""

    def __init__(self, base_url: str) -> None:
        from rlcli.client import endpoint

        self.base_url = base_url.rstrip("/")
        self.caps = endpoint.get_json(self.base_url, "/api/v1/get_server_capabilities")

    @property
    def backend(self) -> str | None:
        return self.caps.get("backend")

    def check_model(self, model: str) -> None:
        served = [
            m.get("model_name")
            for m in self.caps.get("supported_models") or []
            if isinstance(m, dict) and m.get("model_name")
        ]
        if not served or any(_same_model(model, s) for s in served):
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
        from rlcli.client import endpoint

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

    def check_loss_config_values(self, model: str, loss: str, config: dict | None) -> None:
        """A one-datum ``forward`` with the loss and its config: the server refuses bad values
        (400) here, not after the first batch of rollouts."""
        if not config:
            return
        import tinker

        from rlcli.recipes.loss_guard import probe_forward

        try:
            probe_forward(self.base_url, model, loss, config)
        except (tinker.BadRequestError, tinker.UnprocessableEntityError) as e:
            raise RlcliError(f"--loss-config {_json(config)}: {_detail(e)}") from None
        except ValueError as e:  # SkyRL's 400 arrives when the SDK retrieves the result
            if "Error code: 400" not in str(e) and "Error code: 422" not in str(e):
                raise
            first = " ".join(str(e).split())[:300]
            raise RlcliError(
                f"--loss-config {_json(config)}: refused by the server: {first}"
            ) from None


def _same_model(given: str, served: str) -> bool:
    if given == served:
        return True
    a, b = Path(given).expanduser(), Path(served).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _json(value) -> str:
    import json

    return json.dumps(value)


def _detail(error) -> str:
    """The server's own reason from an SDK HTTP error, on one line."""
    body = getattr(error, "body", None)
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or body
        if isinstance(detail, list | dict):
            detail = _json(detail)
        text = str(detail)
    else:
        text = str(error)
    return (
        f"refused by the server ({getattr(error, 'status_code', '?')}): "
        + " ".join(text.split())[:300]
    )
