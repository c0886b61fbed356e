"""``rlcli restore``: a training state exported with ``--with-optimizer`` back onto a server
(rlcli's: ``PUT /api/v1/rlcli/restore/...``) under its original ``tinker://`` path, so the run
continues there.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rlcli.checkpoint_format import RESTORE_FILES
from rlcli.client import endpoint
from rlcli.client.checkpoint_fetch import Say, human
from rlcli.client.export_output import MANIFEST
from rlcli.client.sample_chat import split_tinker_path
from rlcli.errors import RlcliError
from rlcli.flags import BASE_URL_HELP, option


@dataclass(kw_only=True)
class RestoreOptions:
    """``rlcli restore``'s flags."""

    folder: str = option(help="A folder `rlcli export --with-optimizer` wrote.", argument=True)
    overwrite: bool = option(False, "Replace a checkpoint of that path already on the server.")
    force: bool = option(
        False, "Accept a server whose base model has another name (same weights, another path)."
    )
    base_url: str | None = option(None, BASE_URL_HELP)
    json: bool = option(False, "Print the result as JSON.", saved=False)


def restore(
    url: str, folder: Path, *, overwrite: bool = False, force: bool = False, say: Say
) -> dict[str, Any]:
    """Put a training state exported with ``--with-optimizer`` on the server at ``url`` under
    its original ``tinker://`` path (so a run's ``checkpoints.jsonl`` still names it)."""
    folder = Path(folder).expanduser()
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        raise RlcliError(
            f"{folder}: no {MANIFEST} here (not a folder rlcli export wrote)"
        ) from None
    if not manifest.get("with_optimizer"):
        raise RlcliError(
            f"{folder}: exported without --with-optimizer; export the training state with "
            "--with-optimizer to continue training elsewhere"
        )
    missing = [n for n in RESTORE_FILES if not (folder / n).is_file()]
    if missing:
        raise RlcliError(f"{folder}: missing {', '.join(missing)}")
    path = manifest["source"]
    run_id, kind, name = split_tinker_path(path, "source")
    fd, tar_path = tempfile.mkstemp(suffix=".tar")
    try:
        with open(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            for n in RESTORE_FILES:
                tar.add(folder / n, arcname=n)
        size = Path(tar_path).stat().st_size
        say(f"uploading {human(size)} to {url} as {path} ...")
        params = {"overwrite": str(overwrite).lower(), "force": str(force).lower()}
        route = f"/api/v1/rlcli/restore/{run_id}/{kind}/{name}"
        try:
            with open(tar_path, "rb") as body:
                response = httpx.put(
                    f"{url}{route}",
                    content=body,
                    params=params,
                    headers={**endpoint.headers(), "Content-Type": "application/x-tar"},
                    timeout=600,
                )
        except httpx.HTTPError as e:
            raise RlcliError(f"no answer from {url}{route} ({type(e).__name__})") from None
    finally:
        Path(tar_path).unlink(missing_ok=True)
    if response.status_code in (404, 405):
        raise RlcliError(f"the server at {url} takes no restores (only rlcli's own server does)")
    if response.status_code >= 400:
        raise RlcliError(f"{url} refused the state (HTTP {response.status_code}): "
                         f"{endpoint._detail(response)}")  # fmt: skip
    return {"tinker_path": path, "server": url, "base_model": manifest.get("base_model"),
            "bytes": response.json().get("size_bytes")}  # fmt: skip
