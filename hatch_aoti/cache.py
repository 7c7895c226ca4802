"""A content-addressed store of compiled, verified artifacts.

Entries are keyed by a digest of everything that changes the compiled output (see
``fingerprint.py``), never by timestamps. An entry is written under a temporary name
and renamed into place in one step, so a build killed mid-write leaves nothing a later
build accepts; every file's sha256 is recorded and checked on each hit, so a corrupted
entry is discarded and rebuilt instead of shipped.

Layout: ``<root>/v1/<key[:2]>/<key>/{entry.json, artifact/...}``; ``<root>/v1/tmp/`` holds
entries being written; ``<root>/v1/recent/`` holds each project's keys at its last build.
``<root>/bytecode/`` belongs to the worker's bytecode store (``bytecode.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hatch_aoti.artifacts import sha256

FORMAT = "v1"
ENV_DIR = "HATCH_AOTI_CACHE_DIR"
ENV_DISABLE = "HATCH_AOTI_NO_CACHE"
STALE_TMP_SECONDS = 24 * 3600


def default_root() -> Path:
    """Per-user cache directory, outside any build environment."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("hatch-aoti", appauthor=False))


def from_env(environ: dict[str, str] | None = None) -> CompileCache | None:
    """The cache the environment asks for; ``None`` when ``HATCH_AOTI_NO_CACHE`` is set."""
    env = os.environ if environ is None else environ
    if env.get(ENV_DISABLE, "").strip().lower() not in ("", "0", "false", "no"):
        return None
    root = env.get(ENV_DIR)
    return CompileCache(Path(root).expanduser() if root else default_root())


@dataclass
class CompileCache:
    root: Path

    @property
    def _base(self) -> Path:
        return self.root / FORMAT

    def _entry_dir(self, key: str) -> Path:
        return self._base / key[:2] / key

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
        files = record.get("files")
        if record.get("key") != key or not isinstance(files, dict) or not self._intact(artifact, files):
            self._discard(entry_dir)
            return None
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(artifact, dest)
        return record

    def has(self, key: str) -> bool:
        """Whether an entry exists (unchecked: :meth:`lookup` does the checking)."""
        return (self._entry_dir(key) / "entry.json").is_file()

    def recall(self, project: str) -> dict[str, str]:
        """The cache keys of ``project``'s models at its last successful build, by model.

        Only a guess at what the next build will hit, used to decide how many workers
        to start; the keys computed from the exported programs decide everything else.
        """
        try:
            data = json.loads(self._recent_file(project).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        models = data.get("models") if isinstance(data, dict) else None
        return {k: v for k, v in models.items() if isinstance(v, str)} if isinstance(models, dict) else {}

    def remember(self, project: str, keys: dict[str, str]) -> None:
        path = self._recent_file(project)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            tmp.write_text(json.dumps({"project": project, "models": keys}, indent=1), encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _recent_file(self, project: str) -> Path:
        return self._base / "recent" / f"{hashlib.sha256(project.encode()).hexdigest()[:24]}.json"

    def store(self, key: str, artifact: Path, record: dict[str, Any]) -> None:
        """Add an entry atomically; a concurrent writer of the same key wins harmlessly."""
        tmp_root = self._base / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        self._sweep(tmp_root)
        tmp = tmp_root / uuid.uuid4().hex
        try:
            shutil.copytree(artifact, tmp / "artifact")
            files = {
                p.relative_to(tmp / "artifact").as_posix(): sha256(p)
                for p in sorted((tmp / "artifact").rglob("*"))
                if p.is_file()
            }
            full = {**record, "key": key, "files": files}
            (tmp / "entry.json").write_text(json.dumps(full, indent=1), encoding="utf-8")
            final = self._entry_dir(key)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _intact(artifact: Path, files: dict[str, str]) -> bool:
        present = {p.relative_to(artifact).as_posix() for p in artifact.rglob("*") if p.is_file()}
        if present != set(files):
            return False
        return all(sha256(artifact / rel) == digest for rel, digest in files.items())

    @staticmethod
    def _discard(entry_dir: Path) -> None:
        # Rename first so no reader sees a half-deleted entry, then delete.
        doomed = entry_dir.with_name(f"{entry_dir.name}.discard-{uuid.uuid4().hex}")
        try:
            os.rename(entry_dir, doomed)
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    @staticmethod
    def _sweep(tmp_root: Path) -> None:
        """Remove what builds killed mid-write left behind (older than a day)."""
        cutoff = time.time() - STALE_TMP_SECONDS
        for leftover in tmp_root.iterdir():
            try:
                if leftover.stat().st_mtime < cutoff:
                    shutil.rmtree(leftover, ignore_errors=True)
            except OSError:
                pass
