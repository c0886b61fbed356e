"""The venv with the 0.25 generation of the SDK and its cookbook (``.venv-sdk025`` beside the
checkout, or ``$RLCLI_OLD_SDK_VENV``): built once from PyPI, reused after. Standard library
only, so ``.ci/run`` can build it with the system Python while the main venv installs; the
tests' ``old_sdk_python`` fixture calls ``ensure()`` (one builder at a time: a file lock)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

OLD_SDK = ("tinker==0.25.0", "tinker-cookbook[math-rl]==0.5.7")


def ensure() -> str:
    """The venv's python, built first if it is missing or holds another SDK."""
    venv = Path(
        os.environ.get("RLCLI_OLD_SDK_VENV") or Path(__file__).parent.parent / ".venv-sdk025"
    )
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import tinker, tinker_cookbook; print(tinker.__version__)"]
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (
            python.exists()
            and subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "0.25.0"
        ):
            return str(python)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # torch pinned: a bare `torch` would resolve to a multi-GB CUDA build on a CPU box.
        subprocess.run(installer(python) + ["torch==2.13.0", *OLD_SDK], check=True, timeout=1800)
    return str(python)


def installer(python: Path) -> list[str]:
    """uv where .ci/run names one (``$RLCLI_UV``) and pip has find-links for the on-disk CPU
    torch (``$PIP_FIND_LINKS``): the same versions in a third of the time. Else pip."""
    uv, links = os.environ.get("RLCLI_UV"), os.environ.get("PIP_FIND_LINKS")
    if uv and links and Path(uv).exists():
        return [uv, "pip", "install", "-q", "--python", str(python), "--compile-bytecode",
                "--find-links", links]  # fmt: skip
    return [str(python), "-m", "pip", "install", "-q"]


if __name__ == "__main__":
    print(ensure())
