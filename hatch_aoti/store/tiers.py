"""The compile cache as one build sees it: this machine's cache first, then the remote tier.

A remote hit is checked, then kept locally; a model compiled and verified here goes to both.
Nothing the remote tier does fails a build: a damaged entry compiles here, and a store that
fails is reported once and not asked again by this build.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hatch_aoti.store.cache import CompileCache, NoSpace, record_files, record_problem
from hatch_aoti.store.remote import Damaged, Fault, RemoteCache


class Tiers:
    def __init__(
        self, local: CompileCache | None, remote: RemoteCache | None, notice: Callable[[str], None], scratch: Path
    ) -> None:
        """``scratch``: where downloads arrive, on the staged artifacts' filesystem and outside the package."""
        self.local, self.remote, self.notice, self.scratch = local, remote, notice, scratch
        self.down = False

    @property
    def enabled(self) -> bool:
        return self.local is not None or self.remote is not None

    def lookup(self, name: str, key: str, backend: str, dest: Path) -> tuple[dict[str, Any], str] | None:
        """The entry's record and the tier it came from (``local``, ``remote``), its artifact in
        ``dest``; ``None`` on a miss. Raises :class:`NoSpace` when the disk is full."""
        if self.local is not None:
            try:
                record = self.local.lookup(key, dest)
            except OSError as exc:  # an unreadable cache is a miss, not a failed build
                self.notice(f"{name}: could not read the compile cache ({exc})")
                record = None
            problem = None if record is None else record_problem(record, backend)
            if record is not None and problem is None:
                return record, "local"
            if problem is not None:  # damaged, or written by someone else: a miss, and the model compiles
                self.notice(f"{name}: the compile cache's entry is damaged: its record {problem}; compiling it here")
                self.local.discard(key)
                shutil.rmtree(dest, ignore_errors=True)
        record = self._fetch(name, key, backend, dest)
        if record is None:
            return None
        if self.local is not None:
            self._keep(name, key, dest, record)
        return record, "remote"

    def _fetch(self, name: str, key: str, backend: str, dest: Path) -> dict[str, Any] | None:
        if self.remote is None or self.down:
            return None
        try:
            return self.remote.fetch(key, backend, dest, self.scratch)
        except Damaged as exc:
            self.notice(f"{name}: the remote compile cache's entry is damaged: {exc}; compiling it here")
            if self.remote.remote.writable:
                try:
                    self.remote.discard(key)
                except Fault as fault:
                    self._fault(fault)
        except Fault as exc:
            self._fault(exc)
        except Exception as exc:  # writing the download here; whatever else, the model compiles
            self.notice(
                f"{name}: could not take the remote compile cache's entry ({type(exc).__name__}: {exc}); "
                "compiling it here"
            )
        return None

    def _keep(self, name: str, key: str, artifact: Path, record: dict[str, Any]) -> None:
        assert self.local is not None
        try:
            self.local.store(key, artifact, record)
        except (OSError, NoSpace) as exc:  # the model is staged; only the local copy is lost
            self.notice(f"{name}: could not keep the remote entry in the compile cache ({exc})")

    def store(self, name: str, key: str, artifact: Path, record: dict[str, Any]) -> None:
        """Keep a verified model in both tiers. Raises :class:`NoSpace` if the local disk is full."""
        if self.local is not None:
            try:
                self.local.store(key, artifact, record)
            except OSError as exc:  # a read-only cache must not fail the build
                self.notice(f"{name}: could not write the compile cache ({exc})")
        if self.remote is None or self.down or not self.remote.remote.writable:
            return
        try:
            self.remote.upload(key, artifact, {**record, "files": record_files(artifact, record)})
        except Fault as exc:
            self._fault(exc)
        except Exception as exc:  # the model is built and kept locally: the build goes on
            self.notice(f"{name}: could not upload to the remote compile cache ({type(exc).__name__}: {exc})")

    def _fault(self, exc: Fault) -> None:
        """Say once that the store failed; this build asks it nothing more."""
        assert self.remote is not None
        self.down = True
        self.notice(
            f"the remote compile cache at {self.remote.remote.url} failed ({exc}); "
            "models not in the local cache compile here, and this build no longer uses it"
        )
