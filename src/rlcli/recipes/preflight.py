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

from rlcli.client import server_info
from rlcli.errors import RlcliError
from rlcli.recipes.loss_guard import probe_forward

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

    from rlcli.compat.renderers import register  # lazy: imports torch, the cookbook, tinker

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


class Server(server_info.Server):
    """``server_info.Server`` and the one check that trains: the loss config's values."""

    def check_loss_config_values(self, model: str, loss: str, config: dict | None) -> None:
        """A one-datum ``forward`` with the loss and its config: the server refuses bad values
        (400) here, not after the first batch of rollouts."""
        if not config:
            return
        import tinker

        try:
            probe_forward(self.base_url, model, loss, config)
        except (tinker.BadRequestError, tinker.UnprocessableEntityError) as e:
            raise RlcliError(
                f"--loss-config {server_info.as_json(config)}: {server_info.server_reason(e)}"
            ) from None
        except ValueError as e:  # SkyRL's 400 arrives when the SDK retrieves the result
            if "Error code: 400" not in str(e) and "Error code: 422" not in str(e):
                raise
            first = " ".join(str(e).split())[:300]
            raise RlcliError(
                f"--loss-config {server_info.as_json(config)}: refused by the server: {first}"
            ) from None
