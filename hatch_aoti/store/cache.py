"""A content-addressed store of compiled, verified artifacts.

Entries are keyed by a digest of everything that changes the compiled output (see
``fingerprint.py``), never by timestamps. An entry is written in a directory of its own
and renamed into place in one step, so a build killed mid-write leaves nothing a later
build accepts (and its leftovers are swept by the next build, see ``owned.py``); every
file's sha256 is recorded and checked on each hit, so a damaged entry is discarded and
rebuilt instead of shipped. Entries never change once in place: concurrent builds that
make the same entry keep whichever lands first.

The cache is capped (``HATCH_AOTI_CACHE_MAX_SIZE``): after each store, the entries used
longest ago go first. A build holds a shared lock on every entry it uses until it ends,
and eviction skips locked entries, so no build loses an entry it is using.

Layout: ``<root>/v2/entries/<key[:2]>/<key>/{entry.json, artifact/...}``, entries being
written in ``<root>/v2/tmp/``. ``<root>/bytecode/`` belongs to the bytecode store.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hatch_aoti.pipeline.artifacts import file_hashes, sha256
from hatch_aoti.pipeline.manifest import entry_problem
from hatch_aoti.store.owned import OwnedDir, sweep

FORMAT = "v2"
ENV_DIR = "HATCH_AOTI_CACHE_DIR"
ENV_DISABLE = "HATCH_AOTI_NO_CACHE"
ENV_MAX_SIZE = "HATCH_AOTI_CACHE_MAX_SIZE"
#: Under the cache root: compiled code of the worker's imports (``hatch_aoti.worker.bytecode``).
BYTECODE_DIR = "bytecode"
#: Room for a few models of several GB each, or hundreds of small ones.
DEFAULT_MAX_SIZE = 20 * 2**30
_WRITING = "entry-"
_UNITS = {
    "": 1,
    "B": 1,
    "K": 2**10,
    "KB": 2**10,
    "KIB": 2**10,
    "M": 2**20,
    "MB": 2**20,
    "MIB": 2**20,
    "G": 2**30,
    "GB": 2**30,
    "GIB": 2**30,
    "T": 2**40,
    "TB": 2**40,
    "TIB": 2**40,
}


class NoSpace(Exception):
    """Not enough disk space for what the build must write; the message says where and how much."""

    def __init__(self, path: Path, needed: int) -> None:
        try:
            free = shutil.disk_usage(path if path.exists() else path.parent).free
        except OSError:
            free = 0
        self.path, self.needed = path, needed
        super().__init__(f"not enough disk space in {path}: {human(needed)} needed, {human(free)} free")


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` is a full disk: an OSError, or a compiler's error that says so."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(text in str(exc) for text in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)))


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # not reached


def parse_size(text: str) -> int:
    """``20GB``, ``512 MiB``, ``1048576``: bytes; :class:`ValueError` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"{ENV_MAX_SIZE} must be a size such as 20GB, 512MB or a number of bytes, not {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def tree_size(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if there is none); what vanishes meanwhile counts 0."""
    return tree_usage(path)[1]


def tree_usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``, in one walk; what vanishes meanwhile is not counted."""
    count = total = 0
    for folder, _, files in os.walk(path):  # errors (a folder removed meanwhile) are skipped
        for name in files:
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(folder, name))
                if stat.S_ISREG(info.st_mode):
                    count, total = count + 1, total + info.st_size
    return count, total


def record_files(artifact: Path, record: dict[str, Any]) -> dict[str, str]:
    """sha256 of each of an entry's files, reusing the digests the build made (weights can be GBs)."""
    known = (record.get("entry") or {}).get("files") or {}
    return file_hashes(artifact, known if isinstance(known, dict) else {})


def record_problem(record: dict[str, Any], backend: str) -> str | None:
    """What keeps the build from using a cache record's manifest entry and verification report, or
    ``None``: a record either tier finds failing it is a miss, and the model compiles again."""
    entry: Any = record.get("entry")
    errors = record.get("errors")
    problem = entry_problem(entry)
    if problem is not None:
        return f"has an unusable manifest entry: {problem}"
    if entry.get("files") != record["files"]:
        return "has a manifest entry whose files are not its own"
    if entry.get("backend") != backend:
        return f"is not of the {backend} backend"
    report = entry.get("verification")
    if not isinstance(report, dict) or report.get("passed") not in (True, None):
        return "has no verification report"
    if not isinstance(report.get("tried", []), list):
        return "has an unusable verification report"
    measured = ("rel_error", "cosine") if "precision" in report else ("max_abs_err",)  # a variant's, or float32's
    if errors is not None and not (
        isinstance(errors, dict) and all(type(errors.get(k)) in (int, float) for k in measured)
    ):
        return "has unusable errors"
    return None


def default_root() -> Path:
    """Per-user cache directory, outside any build environment."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("hatch-aoti", appauthor=False))


def disabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV_DISABLE, "").strip().lower() not in ("", "0", "false", "no")


def from_env(environ: dict[str, str] | None = None) -> CompileCache | None:
    """The cache the environment asks for; ``None`` when ``HATCH_AOTI_NO_CACHE`` is set."""
    return None if disabled(environ) else configured(environ)


def configured(environ: dict[str, str] | None = None) -> CompileCache:
    """The cache at ``HATCH_AOTI_CACHE_DIR`` (or the default) with its cap, whether builds use it or not."""
    env = os.environ if environ is None else environ
    root = env.get(ENV_DIR)
    cap = env.get(ENV_MAX_SIZE, "").strip()
    return CompileCache(
        Path(root).expanduser().absolute() if root else default_root(), parse_size(cap) if cap else DEFAULT_MAX_SIZE
    )


def untrusted(root: Path, uid: int | None = None) -> str | None:
    """Why the cache at ``root`` must not be used, or ``None``.

    A hit is shipped in wheels as found, so whoever can write the cache can put code into
    every wheel built from it. As ssh treats key files: the directory must belong to this
    user and be writable by nobody else, and no directory above where it really is (its
    symlinks resolved) may let others replace it (writable by its group or by anyone
    without the sticky bit, or owned by another user).
    """
    uid = os.getuid() if uid is None else uid
    if root.exists():
        info = root.stat()
        if info.st_uid != uid:
            return f"it belongs to another user (uid {info.st_uid})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"other users can write to it (mode {stat.S_IMODE(info.st_mode):o}); run `chmod go-w {root}`"
    for parent in root.resolve().parents:  # where it is, its symlinks followed: each of those may replace it
        if not parent.exists():
            continue
        info = parent.stat()
        if info.st_uid not in (uid, 0):
            return f"{parent} above it belongs to another user (uid {info.st_uid})"
        if info.st_mode & stat.S_ISVTX:  # like /tmp: only a file's owner may rename it
            continue
        if info.st_mode & stat.S_IWOTH:
            return f"anyone can replace it: {parent} above it is world-writable without the sticky bit"
        if info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid, uid):
            return f"its group can replace it: {parent} above it is group-writable; run `chmod g-w {parent}`"
    return None


def _private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is the user's own group (their primary group, with no other members listed), which
    a umask of 002 gives new directories on systems of user-private groups: its write bit lets nobody else
    in (Debian's ssh accepts it too)."""
    import grp
    import pwd

    try:
        return pwd.getpwuid(uid).pw_gid == gid and not [
            m for m in grp.getgrgid(gid).gr_mem if m != pwd.getpwuid(uid).pw_name
        ]
    except KeyError:
        return False


@dataclass
class CompileCache:
    root: Path
    max_size: int = DEFAULT_MAX_SIZE
    _held: dict[str, int] = field(default_factory=dict, repr=False)
    """Entries this process uses, by key: open fds holding a shared lock until the process ends."""

    @property
    def _base(self) -> Path:
        return self.root / FORMAT

    def _entry_dir(self, key: str) -> Path:
        return self._base / "entries" / key[:2] / key

    def create(self) -> None:
        """Make the root private (mode 700), creating it if need be, before anything is written in it:
        what builds create inside follows the umask, and nobody else may reach it."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if stat.S_IMODE(self.root.stat().st_mode) & 0o077:
            self.root.chmod(0o700)

    def lookup(self, key: str, dest: Path) -> dict[str, Any] | None:
        """Copy a valid entry's artifact to ``dest`` and return its record; ``None`` on a miss.

        The entry is locked (shared) first, so eviction cannot take it away meanwhile; one
        that fails its checks is removed, so the build that finds it rebuilds it.
        """
        entry_dir = self._entry_dir(key)
        if not (entry_dir / "entry.json").exists() or not self._hold(key, entry_dir):
            return None
        try:
            record = json.loads((entry_dir / "entry.json").read_text(encoding="utf-8"))
            files = record.get("files") if isinstance(record, dict) else None
            intact = (
                record.get("key") == key and isinstance(files, dict) and self._intact(entry_dir / "artifact", files)
            )
        except (OSError, ValueError, AttributeError):
            intact = False
        if not intact:
            self._discard(entry_dir)
            return None
        if dest.exists():
            shutil.rmtree(dest)
        try:
            shutil.copytree(entry_dir / "artifact", dest)
        except OSError as exc:
            if out_of_space(exc):
                raise NoSpace(dest.parent, int(record.get("size", 0))) from None
            raise
        return record

    def store(self, key: str, artifact: Path, record: dict[str, Any]) -> bool:
        """Add an entry atomically; ``False`` if another build stored the same key first.

        Raises :class:`NoSpace`, with nothing half-written left behind, when the disk is full.
        """
        size = tree_size(artifact)
        self.create()
        if shutil.disk_usage(self.root).free < size:
            raise NoSpace(self.root, size)
        tmp_root = self._base / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        sweep(tmp_root, _WRITING)
        writing = OwnedDir.create(tmp_root, _WRITING)
        try:
            stored = self._write(key, artifact, {**record, "size": size}, writing.path / "entry")
        except OSError as exc:
            if out_of_space(exc):
                raise NoSpace(self.root, size) from None
            raise
        finally:
            writing.release()
        self._hold(key, self._entry_dir(key))
        self.evict()
        return stored

    def _write(self, key: str, artifact: Path, record: dict[str, Any], entry: Path) -> bool:
        shutil.copytree(artifact, entry / "artifact")
        # The digests the build made of these files are not made again (weights can be GBs):
        # a copy that went wrong fails the check of the next lookup, which discards the entry.
        full = {**record, "key": key, "files": record_files(entry / "artifact", record)}
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

    def evict(self) -> list[Path]:
        """Remove the entries used longest ago until the cache fits its cap, skipping any a build uses."""
        entries = [(used, record["size"], entry_dir) for entry_dir, record, used in self.records()]
        total, evicted = sum(size for _, size, _ in entries), []
        for _, size, entry_dir in sorted(entries):
            if total <= self.max_size:
                break
            if self._remove(entry_dir):
                total -= size
                evicted.append(entry_dir)
        return evicted

    def clear(self) -> tuple[list[Path], list[Path]]:
        """Remove every entry no build is using: (removed, in use)."""
        removed: list[Path] = []
        in_use: list[Path] = []
        for entry_dir in self.entries():
            (removed if self._remove(entry_dir) else in_use).append(entry_dir)
        return removed, in_use

    def records(self) -> list[tuple[Path, dict[str, Any], float]]:
        """Each readable entry's directory, record (its ``size`` checked), and when a build last used it."""
        found = []
        for entry_dir in self.entries():
            try:
                used = (entry_dir / "entry.json").stat().st_mtime
                record = json.loads((entry_dir / "entry.json").read_text(encoding="utf-8"))
                if not isinstance(record, dict):
                    continue
                if not isinstance(record.get("size"), int):  # an entry from before sizes were recorded
                    record["size"] = tree_size(entry_dir / "artifact")
            except (OSError, ValueError):
                continue
            found.append((entry_dir, record, used))
        return found

    def _remove(self, entry_dir: Path) -> bool:
        """Remove an entry unless a build (this one or another) holds it."""
        fd = None if entry_dir.name in self._held else self._exclusive(entry_dir)
        if fd is None:
            return False
        self._discard(entry_dir)
        os.close(fd)
        return True

    def _hold(self, key: str, entry_dir: Path) -> bool:
        """Lock the entry shared for as long as this process lives, and record its use (for eviction)."""
        if key in self._held:
            return True
        try:
            fd = os.open(entry_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not (entry_dir / "entry.json").exists():  # evicted before we locked it
            os.close(fd)
            return False
        self._held[key] = fd
        os.utime(entry_dir / "entry.json")
        return True

    @staticmethod
    def _exclusive(entry_dir: Path) -> int | None:
        """An fd holding an exclusive lock on the entry, or ``None`` if any build holds it."""
        try:
            fd = os.open(entry_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

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

    def discard(self, key: str) -> None:
        """Remove an entry found unusable (its record fails the build's checks), so that it is rebuilt."""
        self._discard(self._entry_dir(key))

    def _discard(self, entry_dir: Path) -> None:
        """Move an entry (damaged or evicted) out of the way in one step, then delete it.

        It goes to the unlocked part of ``tmp/``, so if the deletion is cut short the next
        build's sweep finishes it.
        """
        fd = self._held.pop(entry_dir.name, None)
        if fd is not None:
            os.close(fd)
        doomed = self._base / "tmp" / f"{_WRITING}discarded-{uuid.uuid4().hex}"
        try:
            doomed.parent.mkdir(parents=True, exist_ok=True)
            os.rename(entry_dir, doomed)
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)
