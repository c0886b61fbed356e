"""Archive downloads: one tar per checkpoint version, built once and shared.

Concurrent downloads of one archive (the same version, the same files) share one tar: the
first builds it (in a thread, in the checkpoints' staging folder, so on their disk and not in a
RAM-backed temp dir), the others wait for it, and the last download to end removes it, also when
a client goes away mid-download. A build that fails removes its partial tar.
"""

from __future__ import annotations

import asyncio
import contextlib
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fastapi.responses import FileResponse

from rlcli.checkpoint_format import ARCHIVE_FILES

Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class _Shared:
    build: asyncio.Future  # -> the tar's path
    users: int = 0


class Archives:
    def __init__(self, folder: Path) -> None:
        self.folder = folder  # where tars are built (created on first use)
        self._shared: dict[Key, _Shared] = {}

    async def acquire(self, version: Path, extra: dict[str, Path]) -> tuple[Key, Path]:
        """The tar of ``version`` (its files plus ``extra``: name in the tar -> file), built
        now or shared with a download in progress. Pair with ``release(key)``."""
        key = (str(version), tuple(sorted((n, str(p)) for n, p in extra.items())))
        shared = self._shared.get(key)
        if shared is None:
            build = asyncio.ensure_future(asyncio.to_thread(self.build, version, extra))
            shared = self._shared[key] = _Shared(build)
        shared.users += 1
        try:
            return key, await asyncio.shield(shared.build)
        except BaseException:
            self.release(key)
            raise

    def release(self, key: Key) -> None:
        """One download of ``key`` ended; the last one removes the tar."""
        shared = self._shared.get(key)
        if shared is None:
            return
        shared.users -= 1
        if shared.users > 0:
            return
        del self._shared[key]
        shared.build.add_done_callback(_remove_result)  # now, or once a build in flight ends

    def response(self, key: Key, path: Path, filename: str) -> FileResponse:
        """A download of the tar that releases it however the download ends."""
        return _Releasing(path, lambda: self.release(key), filename=filename)

    def build(self, version: Path, extra: dict[str, Path]) -> Path:
        """Write the tar; on any failure nothing is left behind."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(suffix=".tar", dir=self.folder)
        try:
            with open(fd, "wb") as out, tarfile.open(fileobj=out, mode="w") as tar:
                for file in ARCHIVE_FILES:
                    tar.add(version / file, arcname=file)
                for file, path in extra.items():
                    tar.add(path, arcname=file)
                tar.addfile(tarfile.TarInfo("checkpoint_complete"))  # `tinker ... push-hf`
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
        return Path(name)

    def count(self) -> int:
        return len(self._shared)


def _remove_result(build: asyncio.Future) -> None:
    if not build.cancelled() and build.exception() is None:
        build.result().unlink(missing_ok=True)


class _Releasing(FileResponse):
    def __init__(self, path: Path, release, **kwargs) -> None:
        super().__init__(path, media_type="application/x-tar", **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                self._release()
