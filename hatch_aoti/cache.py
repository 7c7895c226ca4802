"""A content-addressed store of compiled, verified artifacts.

Entries are keyed by a digest of everything that changes the compiled output (see
``fingerprint.py``), never by timestamps. An entry is written in a directory of its own
and renamed into place in one step, so a build killed mid-write leaves nothing a later
build accepts (and its leftovers are swept by the next build, see ``owned.py``); every
file's sha256 is recorded and checked on each hit, so a damaged entry is discarded and
rebuilt instead of shipped. Entries never change once in place: concurrent builds that
make the same entry keep whichever lands first.

Layout: ``<root>/v2/entries/<key[:2]>/<key>/{entry.json, artifact/...}``, entries being
written in ``<root>/v2/tmp/``. ``<root>/bytecode/`` belongs to the bytecode store.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hatch_aoti.artifacts import sha256
from hatch_aoti.owned import OwnedDir, sweep

FORMAT = "v2"
ENV_DIR = "HATCH_AOTI_CACHE_DIR"
ENV_DISABLE = "HATCH_AOTI_NO_CACHE"
_WRITING = "entry-"


def default_root() -> Path:
    """Per-user cache directory, outside any build environment."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("hatch-aoti", appauthor=False))


def disabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV_DISABLE, "").strip().lower() not in ("", "0", "false", "no")


def from_env(environ: dict[str, str] | None = None) -> CompileCache | None:
    """The cache the environment asks for; ``None`` when ``HATCH_AOTI_NO_CACHE`` is set."""
    env = os.environ if environ is None else environ
    if disabled(env):
        return None
    root = env.get(ENV_DIR)
    return CompileCache(Path(root).expanduser().absolute() if root else default_root())


def untrusted(root: Path, uid: int | None = None) -> str | None:
    """Why the cache at ``root`` must not be used, or ``None``.

    A hit is shipped in wheels as found, so whoever can write the cache can put code into
    every wheel built from it. As ssh treats key files: the directory must belong to this
    user and be writable by nobody else, and no directory above it may let others
    replace it (writable by others without the sticky bit, or owned by another user).
    """
    uid = os.getuid() if uid is None else uid
    if root.exists():
        info = root.stat()
        if info.st_uid != uid:
            return f"it belongs to another user (uid {info.st_uid})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"other users can write to it (mode {stat.S_IMODE(info.st_mode):o}); run `chmod go-w {root}`"
    for parent in root.absolute().parents:
        if not parent.exists():
            continue
        info = parent.stat()
        if info.st_uid not in (uid, 0):
            return f"{parent} above it belongs to another user (uid {info.st_uid})"
        if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            return f"anyone can replace it: {parent} above it is world-writable without the sticky bit"
    return None


@dataclass
class CompileCache:
    root: Path

    @property
    def _base(self) -> Path:
        return self.root / FORMAT

    def _entry_dir(self, key: str) -> Path:
        return self._base / "entries" / key[:2] / key

    def lookup(self, key: str, dest: Path) -> dict[str, Any] | None:
        """Copy a valid entry's artifact to ``dest`` and return its record; ``None`` on a miss.

        An entry that fails its checks is removed, so the build that finds it rebuilds it.
        """
        entry_dir = self._entry_dir(key)
        try:
            record = json.loads((entry_dir / "entry.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            self._discard(entry_dir)
            return None
        artifact = entry_dir / "artifact"
        files = record.get("files") if isinstance(record, dict) else None
        if record.get("key") != key or not isinstance(files, dict) or not self._intact(artifact, files):
            self._discard(entry_dir)
            return None
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(artifact, dest)
        return record

    def store(self, key: str, artifact: Path, record: dict[str, Any]) -> bool:
        """Add an entry atomically; ``False`` if another build stored the same key first."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp_root = self._base / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        sweep(tmp_root, _WRITING)
        writing = OwnedDir.create(tmp_root, _WRITING)
        try:
            entry = writing.path / "entry"
            shutil.copytree(artifact, entry / "artifact")
            files = {p.relative_to(entry / "artifact").as_posix(): sha256(p)
                     for p in sorted((entry / "artifact").rglob("*")) if p.is_file()}  # fmt: skip
            full = {**record, "key": key, "files": files}
            (entry / "entry.json").write_text(json.dumps(full, indent=1, sort_keys=True), encoding="utf-8")
            final = self._entry_dir(key)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(entry, final)
            except OSError:
                if not final.exists():
                    raise
                return False
            return True
        finally:
            writing.release()

    def entries(self) -> list[Path]:
        """Directories of the entries in place (complete or damaged)."""
        root = self._base / "entries"
        return sorted(p for p in root.glob("*/*") if p.is_dir())

    @staticmethod
    def _intact(artifact: Path, files: dict[str, str]) -> bool:
        present = {p.relative_to(artifact).as_posix() for p in artifact.rglob("*") if p.is_file()}
        if present != set(files):
            return False
        return all(sha256(artifact / rel) == digest for rel, digest in files.items())

    def _discard(self, entry_dir: Path) -> None:
        """Move a damaged entry out of the way in one step, then delete it.

        It goes to the unlocked part of ``tmp/``, so if the deletion is cut short the next
        build's sweep finishes it.
        """
        doomed = self._base / "tmp" / f"{_WRITING}discarded-{uuid.uuid4().hex}"
        try:
            doomed.parent.mkdir(parents=True, exist_ok=True)
            os.rename(entry_dir, doomed)
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)
