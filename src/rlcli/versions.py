"""The versions of the packages a result depends on, for status pages and receipts."""

from __future__ import annotations


def installed_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("tinker", "tinker-cookbook", "torch", "transformers", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out
