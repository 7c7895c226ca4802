"""Directories owned by a running build: created under an exclusive lock that lives as long as the build.

The kernel drops the lock when its process dies, however it dies, so a later build can
tell a killed build's leftovers (unlocked) from a live build's work (locked): it removes
the first and never touches the second.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path


class OwnedDir:
    """A fresh directory, locked by this process until :meth:`release`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def create(cls, parent: Path, prefix: str) -> OwnedDir:
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        while True:
            path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # swept before we could lock it: take another
            if _try_lock(fd) and os.fstat(fd).st_nlink > 0:
                return cls(path, fd)
            os.close(fd)

    def release(self, remove: bool = True) -> None:
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def sweep(parent: Path, prefix: str) -> list[Path]:
    """Remove the directories under ``parent`` named ``prefix*`` whose builds are gone."""
    removed: list[Path] = []
    try:
        candidates = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for path in candidates:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if _try_lock(fd):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def _try_lock(fd: int) -> bool:
    with contextlib.suppress(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    return False
