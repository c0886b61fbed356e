"""Aliases: a stable model name (``prod``) for whichever checkpoint is being served now.

An alias is a list of versions, each a checkpoint (a ``tinker://.../sampler_weights/...``
path, or the base model) with who set it and why; the alias serves one of them (``current``).
``set`` appends a version, ``rollback`` points back at an earlier one (and is logged as a switch
too). The whole table is one JSON file beside the checkpoints it names (``aliases.json`` in the
checkpoints folder), replaced whole on every switch (``files/atomic``, fsynced), so a server
restarted after any crash reads the table before or after a switch, never half of one.

Atomic switch: a request resolves an alias once, when it arrives (``resolve``), and every row
of it samples from that checkpoint; the next request sees the new one. The table in memory is
swapped only after the file is written, under a lock, so readers never see a switch that did
not persist.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from rlcli.files import atomic
from rlcli.server.errors import UserError

FILE = "aliases.json"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")


class AliasError(UserError):
    """A refused alias operation; the message names the alias and why."""


class UnknownAlias(AliasError):
    status = 404


class MissingCheckpoint(AliasError):
    status = 404


def check_alias_name(name: str) -> str:
    """A name that cannot be mistaken for a checkpoint path or a hub id (no ``/`` or ``:``)."""
    if not _NAME.match(name or ""):
        raise AliasError(
            f"alias: {name!r} is not a valid alias name (a letter, then letters, digits, '.', "
            "'_', '-'; at most 64)"
        )
    return name


class Aliases:
    """The alias table of one server, persisted in ``folder/aliases.json``."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / FILE
        self._lock = threading.Lock()
        self._table: dict[str, dict[str, Any]] = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as e:
            raise RuntimeError(f"{self.path}: unreadable alias table ({e})") from None
        return data.get("aliases", {})

    def _commit(self, table: dict[str, dict[str, Any]]) -> None:
        """Persist, then publish: a switch readers can see has reached the disk."""
        text = json.dumps({"aliases": table}, indent=2) + "\n"
        atomic.write_text(self.path, text, fsync=True)
        self._table = table

    # ---- reading ------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._table)

    def resolve(self, name: str) -> dict[str, Any] | None:
        """The version ``name`` serves now, or None if it is not an alias."""
        alias = self._table.get(name)  # one dict read: a switch replaces the whole table
        if alias is None:
            return None
        return alias["versions"][alias["current"] - 1]

    def describe(self, name: str) -> dict[str, Any]:
        alias = self._table.get(name)
        if alias is None:
            raise UnknownAlias(f"alias: no alias {name!r} (rlcli alias list shows them)")
        current = alias["versions"][alias["current"] - 1]
        return {"name": name, "current": alias["current"], "versions": len(alias["versions"]),
                **{k: current[k] for k in ("checkpoint", "state", "base_model")},
                "updated": alias["log"][-1]["time"]}  # fmt: skip

    def history(self, name: str) -> dict[str, Any]:
        self.describe(name)
        alias = self._table[name]
        return {"name": name, "current": alias["current"], "versions": alias["versions"],
                "log": alias["log"]}  # fmt: skip

    def listing(self) -> list[dict[str, Any]]:
        return [self.describe(name) for name in self.names()]

    # ---- switching ----------------------------------------------------------------------

    def set(self, name: str, version: dict[str, Any], by: str, why: str) -> dict[str, Any]:
        """A new version (``checkpoint``, ``state``, ``base_model``), served from now on."""
        check_alias_name(name)
        with self._lock:
            table = json.loads(json.dumps(self._table))  # a copy: readers keep the old one
            alias = table.setdefault(name, {"current": 0, "versions": [], "log": []})
            number = len(alias["versions"]) + 1
            alias["versions"].append({"version": number, **version})
            alias["log"].append(_entry("set", number, alias["current"] or None, version, by, why))
            alias["current"] = number
            self._commit(table)
        return self.describe(name)

    def rollback(self, name: str, to: int | None, by: str, why: str) -> dict[str, Any]:
        """Serve an earlier version again: ``to``, or the one before the current one."""
        self.describe(name)
        with self._lock:
            table = json.loads(json.dumps(self._table))
            alias = table[name]
            current, count = alias["current"], len(alias["versions"])
            target = current - 1 if to is None else to
            if to is None and target < 1:
                raise AliasError(
                    f"alias {name}: version {current} is its first; there is nothing before it "
                    "to roll back to"
                )
            if not 1 <= target <= count:
                raise AliasError(
                    f"--to {to}: alias {name} has versions 1 to {count} (rlcli alias history "
                    f"{name})"
                )
            version = alias["versions"][target - 1]
            alias["log"].append(_entry("rollback", target, current, version, by, why))
            alias["current"] = target
            self._commit(table)
        return self.describe(name)


def _entry(action, number, previous, version, by, why) -> dict[str, Any]:
    return {
        "time": time.time(), "action": action, "version": number, "from": previous,
        "checkpoint": version["checkpoint"], "by": by or "unknown", "why": why or "",
    }  # fmt: skip
