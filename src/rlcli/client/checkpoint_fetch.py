"""A checkpoint's files onto this machine, for ``rlcli export``: from the server's archive, or
copied from a checkpoints folder here when the run's server wrote one (no server needed).

The archive comes through the route ``tinker checkpoint download`` uses (``GET
.../checkpoints/KIND/NAME/archive`` -> a ``.tar`` link; a 302 or a JSON answer) and is unpacked
to plain files with plain names only. ``with_optimizer`` asks our server for ``optimizer.pt``
and the run's ``run.json`` too (query ``include_optimizer=true``, rlcli's opt-in; the tinker
CLI's archive is unchanged).
"""

from __future__ import annotations

import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from rlcli import checkpoint_format
from rlcli.checkpoint_format import TinkerPathError, parse_tinker_path
from rlcli.client import endpoint
from rlcli.client.sample_chat import split_tinker_path
from rlcli.errors import RlcliError

Say = Callable[[str], None]


# ---- which checkpoint ----------------------------------------------------------------------


def check_source(path: str, with_optimizer: bool) -> tuple[str, str, str]:
    run_id, kind, name = split_tinker_path(path)
    if with_optimizer and kind != "weights":
        raise RlcliError(
            f"--with-optimizer: {path} is sampler weights (no optimizer state); pass the "
            f"training state, e.g. tinker://{run_id}/weights/{name}"
        )
    return run_id, kind, name


# ---- download ------------------------------------------------------------------------------


def archive_url(url: str, path: str, with_optimizer: bool) -> str:
    run_id, kind, name = check_source(path, with_optimizer)
    route = f"/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/archive"
    params = {"include_optimizer": "true"} if with_optimizer else None
    try:
        response = httpx.get(
            f"{url}{route}", params=params, headers=endpoint.headers(), timeout=300
        )
    except httpx.HTTPError as e:
        raise RlcliError(f"no answer from {url}{route} ({type(e).__name__})") from None
    if response.status_code in (301, 302, 303, 307) and response.headers.get("location"):
        return response.headers["location"]
    if response.status_code == 404:
        raise RlcliError(f"{path}: the server at {url} has no such checkpoint")
    if response.status_code >= 400:
        raise RlcliError(f"{path}: {url} answered HTTP {response.status_code}: "
                         f"{endpoint._detail(response)}")  # fmt: skip
    try:
        link = response.json()["url"]
    except (ValueError, KeyError, TypeError):
        raise RlcliError(f"{url}{route} answered no archive link") from None
    if with_optimizer and "/rlcli/archives/" not in link:
        raise RlcliError(
            f"--with-optimizer: the server at {url} is not rlcli's; its archives leave the "
            "optimizer state out"
        )
    return link


def download(link: str, dest: Path, say: Say) -> int:
    """Fetch the archive to ``dest``; its size in bytes."""
    size = 0
    started = time.monotonic()
    try:
        with httpx.stream("GET", link, timeout=300, follow_redirects=True) as response:
            if response.status_code >= 400:
                response.read()
                raise RlcliError(
                    f"the archive download answered HTTP {response.status_code}: "
                    f"{endpoint._detail(response)}"
                )
            with open(dest, "wb") as out:
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)
                    size += len(chunk)
    except httpx.HTTPError as e:
        raise RlcliError(f"the archive download failed ({type(e).__name__})") from None
    say(f"downloaded {human(size)} in {time.monotonic() - started:.1f}s")
    return size


# ---- or read from this machine ------------------------------------------------------------


def local_version(path: str, root: Path) -> Path | None:
    """The version folder of checkpoint ``path`` under a checkpoints folder on this machine
    (what ``serve start`` writes, ``$RLCLI_HOME/checkpoints`` by default), or None. Run ids are
    UUIDs, so a folder of that name holds that run's checkpoints and no other server's."""
    try:
        ref = parse_tinker_path(path)
    except TinkerPathError:
        return None
    return checkpoint_format.resolve(ref.folder(root))


def copy_local(version: Path, folder: Path, wanted: tuple[str, ...]) -> None:
    """``wanted`` from a version folder (and ``run.json`` from its run's folder) into
    ``folder``: the files the server's archive of that checkpoint would hold."""
    run_json = version.parent.parent / "run.json"
    for name in wanted:
        source = run_json if name == "run.json" else version / name
        if source.is_file():
            shutil.copyfile(source, folder / name)
    missing = [n for n in wanted if n != "checkpoint.json" and not (folder / n).is_file()]
    if missing:
        raise RlcliError(f"{version}: the checkpoint lacks {', '.join(missing)}")


def fetch(origin: str | Path, path: str, folder: Path, wanted, work: Path, say: Say) -> None:
    """The checkpoint's ``wanted`` files into ``folder``: copied from its version folder when
    ``origin`` is one (a ``Path``), else downloaded from the server at ``origin`` (a URL)."""
    if isinstance(origin, Path):
        say(f"reading {path} from {origin} (no server needed)")
        copy_local(origin, folder, wanted)
        return
    link = archive_url(origin, path, "optimizer.pt" in wanted)
    say(f"downloading {path} ...")
    download(link, work / "checkpoint.tar", say)
    unpack(work / "checkpoint.tar", folder, wanted)


def unpack(tar_path: Path, folder: Path, wanted: tuple[str, ...]) -> None:
    """The archive's ``wanted`` files into ``folder``: plain files with plain names only."""
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            for member in tar:
                if member.name not in wanted or not member.isfile():
                    continue
                source = tar.extractfile(member)
                with source, open(folder / member.name, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
    except (tarfile.TarError, EOFError) as e:
        raise RlcliError(f"the downloaded archive is not a whole tar file ({e})") from None
    missing = [n for n in wanted if n != "checkpoint.json" and not (folder / n).is_file()]
    if missing:
        raise RlcliError(f"the server's archive lacks {', '.join(missing)}")


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"
