"""Aliases of a running rlcli server: read, set, roll back (``/rlcli/aliases``), and the
name ``sample``, ``chat``, ``eval`` and ``learn`` turn into a checkpoint.

The server owns the table (``server/state/aliases.py``); this is its client. Each switch is
sent with who made it (``user@host`` and the command) and why, which the server logs.
"""

from __future__ import annotations

import getpass
import socket
import sys
from typing import Any

import httpx

from rlcli.client import endpoint
from rlcli.errors import RlcliError

PATH = "/rlcli/aliases"


def who(command: str | None = None) -> str:
    """``user@host (command)``: the person or program behind a switch."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (a container without one)
        user = "unknown"
    what = command or " ".join(["rlcli", *sys.argv[1:3]])
    return f"{user}@{socket.gethostname()} ({what})"


def _call(method: str, url: str, path: str, body: dict | None = None) -> dict[str, Any]:
    try:
        response = httpx.request(method, f"{url}{path}", json=body, headers=endpoint.headers(),
                                 timeout=30)  # fmt: skip
    except httpx.HTTPError as e:
        raise RlcliError(f"no answer from {url}{path} ({type(e).__name__})") from None
    if response.status_code == 404 and "alias" not in response.text:
        raise RlcliError(f"the server at {url} has no aliases (an rlcli torch server has)")
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail")
        except (ValueError, AttributeError):
            detail = response.text[:300]
        raise RlcliError(str(detail))
    return response.json()


def listing(url: str) -> list[dict[str, Any]]:
    return _call("GET", url, PATH)["aliases"]


def history(url: str, name: str) -> dict[str, Any]:
    return _call("GET", url, f"{PATH}/{name}")


def set_alias(
    url: str, name: str, checkpoint: str, *, state: str | None = None, why: str = "",
    by: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    body = {"checkpoint": checkpoint, "by": by or who(), "why": why}
    if state is not None:
        body["state"] = state
    return _call("PUT", url, f"{PATH}/{name}", body)


def rollback(
    url: str, name: str, to: int | None = None, *, why: str = "", by: str | None = None
) -> dict[str, Any]:
    return _call("POST", url, f"{PATH}/{name}/rollback", {"to": to, "by": by or who(), "why": why})


def is_alias_name(name: str | None) -> bool:
    """A name that can only be an alias: no tinker:// path, no hub id or folder."""
    return bool(name) and "/" not in name and ":" not in name and not name.startswith(".")


def resolve(url: str, name: str) -> dict[str, Any]:
    """The version an alias serves now (``checkpoint``, ``state``, ``base_model``)."""
    try:
        table = history(url, name)
    except RlcliError as e:
        raise RlcliError(f"{name}: not a checkpoint path, and not an alias on {url}: {e}") from None
    return table["versions"][table["current"] - 1]
