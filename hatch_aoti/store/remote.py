"""The compile cache's remote tier: entries shared by a fleet of machines on any fsspec store.

Layout under ``HATCH_AOTI_REMOTE_CACHE``: ``v2/blobs/<sha[:2]>/<sha256>`` holds each file of an
artifact, named by its digest; ``v2/entries/<key[:2]>/<key>.json`` is an entry's record. Blobs
go up first and the record last, written only if absent, so a reader sees a whole entry or
none and two uploaders of one key both succeed. Every blob is checked against its digest on
the way down.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hatch_aoti.pipeline.artifacts import sha256
from hatch_aoti.pipeline.manifest import MAX_FILE_SIZE, inside
from hatch_aoti.store.cache import out_of_space, record_problem

ENV_URL = "HATCH_AOTI_REMOTE_CACHE"
ENV_MODE = "HATCH_AOTI_REMOTE_CACHE_MODE"
ENV_TIMEOUT = "HATCH_AOTI_REMOTE_CACHE_TIMEOUT"
MODES = ("read-write", "read-only")
FORMAT = "v2"
DEFAULT_TIMEOUT = 30.0
#: A transfer may take the timeout plus one second per MiB it moves.
SECONDS_PER_BYTE = 1 / 2**20
#: The extra of hatch-aoti that brings a protocol's package.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_DIGEST = re.compile(r"[0-9a-f]{64}")
T = TypeVar("T")


@dataclass(frozen=True)
class Remote:
    """Where the remote tier is and how builds may use it, as the environment says."""

    url: str
    mode: str = "read-write"
    timeout: float = DEFAULT_TIMEOUT

    @property
    def writable(self) -> bool:
        return self.mode == "read-write"

    def describe(self) -> str:
        return f"{self.url} ({self.mode})"


class Fault(Exception):
    """The store failed or did not answer in time: the build stops asking it."""


class Damaged(Exception):
    """An entry that fails its checks: its model compiles here."""


def from_env(environ: dict[str, str] | None = None) -> Remote | None:
    """The remote tier the environment asks for, or ``None``; :class:`ValueError` says what is wrong."""
    env = os.environ if environ is None else environ
    url = env.get(ENV_URL, "").strip()
    if not url:
        return None
    mode = env.get(ENV_MODE, "").strip().lower() or "read-write"
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE} must be read-write or read-only, not {mode!r}")
    timeout = _timeout(env.get(ENV_TIMEOUT, "").strip())
    problem = missing_package(url)
    if problem is not None:
        raise ValueError(problem)
    return Remote(url, mode, timeout)


def _timeout(text: str) -> float:
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{ENV_TIMEOUT} must be a number of seconds above 0, not {text!r}")
    return seconds


def missing_package(url: str) -> str | None:
    """Why ``url``'s protocol cannot be used here, naming what to install; ``None`` if it can.

    Only looked up, not imported: the build backend stays light.
    """
    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    extra = EXTRAS.get(protocol)
    hint = f"install hatch-aoti[{extra}]" if extra else f"install fsspec and the fsspec package for {protocol}://"
    where = f"{hint} where the build runs (for isolated builds, in `build-system.requires`)"
    if importlib.util.find_spec("fsspec") is None:
        return f"{ENV_URL}={url} needs fsspec: {where}"
    from fsspec.registry import known_implementations, registry

    known = known_implementations.get(protocol)
    if known is None:
        return None if protocol in registry else f"{ENV_URL}={url}: fsspec knows no protocol {protocol!r}"
    package = known["class"].split(".")[0]
    if importlib.util.find_spec(package) is None:
        return f"{ENV_URL}={url} needs {package}, which is not installed: {where}"
    return None


def storage_options(protocol: str, timeout: float) -> dict[str, Any]:
    """Timeouts for the protocols whose clients take them; the watchdog in :meth:`RemoteCache._bounded`
    bounds every protocol in any case."""
    if protocol in ("s3", "s3a"):
        retries = {"max_attempts": 3, "mode": "standard"}
        each = max(1.0, timeout / 3)  # room for the retries before the watchdog's deadline
        return {"config_kwargs": {"connect_timeout": each, "read_timeout": each, "retries": retries}}
    if protocol in ("gs", "gcs"):
        return {"requests_timeout": timeout}
    return {}


class RemoteCache:
    """One build's client of the remote tier."""

    def __init__(self, remote: Remote) -> None:
        self.remote = remote
        self._fs: Any = None
        self._base = ""
        self._damaged: set[str] = set()
        """Digests of files this build found damaged in the store: uploads send them again."""

    # -- paths ------------------------------------------------------------------------------

    def _connect(self) -> tuple[Any, str]:
        if self._fs is None:
            from fsspec.core import split_protocol, url_to_fs

            protocol = split_protocol(self.remote.url)[0] or "file"
            options = storage_options(protocol, self.remote.timeout)
            # A client of its own: fsspec would otherwise share one made with other settings.
            self._fs, root = self._bounded(lambda: url_to_fs(self.remote.url, skip_instance_cache=True, **options))
            self._base = f"{root.rstrip('/')}/{FORMAT}"
        return self._fs, self._base

    def _record_path(self, key: str) -> str:
        return f"{self._connect()[1]}/entries/{key[:2]}/{key}.json"

    def _blob_path(self, digest: str) -> str:
        return f"{self._connect()[1]}/blobs/{digest[:2]}/{digest}"

    @functools.cached_property
    def _local(self) -> bool:
        """Whether the store is this machine's filesystem (a shared directory, say)."""
        from fsspec.implementations.local import LocalFileSystem

        return isinstance(self._connect()[0], LocalFileSystem)

    # -- reading ----------------------------------------------------------------------------

    def fetch(self, key: str, backend: str, dest: Path, scratch: Path) -> dict[str, Any] | None:
        """The entry's record, its artifact checked and then renamed to ``dest``; ``None`` on a miss.

        Files arrive in a directory of their own under ``scratch`` (on ``dest``'s filesystem), so
        a transfer given up on can only ever write there. Raises :class:`Damaged` for an entry
        that fails a check, :class:`Fault` if the store fails.
        """
        fs = self._connect()[0]
        try:
            raw = self._bounded(fs.cat_file, self._record_path(key))
        except FileNotFoundError:
            return None
        record = parse_record(raw, key, backend)
        sizes, executable = record.pop("sizes"), record.pop("executable")
        scratch.mkdir(parents=True, exist_ok=True)
        arriving = Path(tempfile.mkdtemp(prefix="remote-", dir=scratch))
        arriving.chmod(0o755)  # as the directory a compile makes
        try:
            for rel, digest in record["files"].items():
                self._download(arriving, rel, digest, sizes[rel])
            for rel in executable:  # wheels keep the mode: a library stays executable
                (arriving / rel).chmod((arriving / rel).stat().st_mode | 0o111)
            if dest.exists():
                shutil.rmtree(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(arriving, dest)
        finally:
            shutil.rmtree(arriving, ignore_errors=True)
        return record

    def _download(self, directory: Path, rel: str, digest: str, size: int) -> None:
        """One file, its size checked before it is fetched (which bounds the time allowed) and its digest after."""
        fs, blob, target = self._connect()[0], self._blob_path(digest), directory / rel
        try:
            found = self._bounded(fs.info, blob).get("size")
        except FileNotFoundError:
            raise Damaged(f"its file {rel} is missing from the store") from None
        if found != size:
            self._damaged.add(digest)
            raise Damaged(f"its file {rel} has {found} bytes, not {size}")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            stop = threading.Event()
            self._bounded(_copy, fs, blob, target, stop, size=size, stop=stop)
        except FileNotFoundError:
            raise Damaged(f"its file {rel} is missing from the store") from None
        except Fault as exc:
            if exc.__cause__ is not None and out_of_space(exc.__cause__):
                raise exc.__cause__ from None  # this machine's disk, not the store
            raise
        if sha256(target) != digest:
            self._damaged.add(digest)
            raise Damaged(f"its file {rel} does not match its digest")

    def discard(self, key: str) -> None:
        """Remove a damaged entry's record, so that the next upload of its key replaces it."""
        fs = self._connect()[0]
        with contextlib.suppress(FileNotFoundError):
            self._bounded(fs.rm_file, self._record_path(key))

    # -- writing ----------------------------------------------------------------------------

    def upload(self, key: str, artifact: Path, record: dict[str, Any]) -> bool:
        """Put an entry: its blobs, then its record if there is none; ``False`` if one was there."""
        path = self._record_path(key)
        if self._bounded(self._connect()[0].exists, path):
            return False
        info = {rel: (artifact / rel).stat() for rel in record["files"]}
        sizes = {rel: stat.st_size for rel, stat in info.items()}
        executable = sorted(rel for rel, stat in info.items() if stat.st_mode & 0o100)
        for rel, digest in record["files"].items():
            self._put_blob(artifact / rel, digest, sizes[rel])
        full = {**record, "key": key, "sizes": sizes, "executable": executable}
        return self._create(path, json.dumps(full, indent=1, sort_keys=True).encode())

    def _put_blob(self, path: Path, digest: str, size: int) -> None:
        """Upload a file unless the store has it (and it was not found damaged); an object store's PUT is
        whole or nothing."""
        fs, blob = self._connect()[0], self._blob_path(digest)
        with contextlib.suppress(FileNotFoundError):
            if digest not in self._damaged and self._bounded(fs.info, blob)["size"] == size:
                return
        if self._local:
            self._bounded(_place, path, Path(blob), size=size)
        else:
            self._bounded(fs.put_file, str(path), blob, size=size)

    def _create(self, path: str, data: bytes) -> bool:
        """Write ``path`` only if absent, in one step: S3's ``If-None-Match``, GCS's generation match,
        a hard link on a local filesystem; ``False`` if it was there."""
        fs = self._connect()[0]
        try:
            if self._local:
                self._bounded(_link, data, Path(path))
            else:
                self._bounded(lambda: fs.pipe_file(path, data, mode="create"))
        except FileExistsError:
            return False
        except Fault:
            # Some stores answer a lost race (or one with a delete) with another error: what is there counts.
            if self._bounded(fs.exists, path):
                return False
            raise
        return True

    # -- the store as a whole ---------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """(entries, bytes of blobs) in the store, for ``hatch-aoti cache info``."""
        fs, base = self._connect()
        entries = self._bounded(fs.find, f"{base}/entries")
        total = self._bounded(lambda: fs.du(f"{base}/blobs") if fs.exists(f"{base}/blobs") else 0)
        return len([e for e in entries if e.endswith(".json")]), int(total)

    def _bounded(self, call: Callable[..., T], *args: Any, size: int = 0, stop: threading.Event | None = None) -> T:
        """``call(*args)`` within the timeout (plus time for ``size`` bytes), in a thread left behind if it hangs;
        ``stop`` is set then, for a call that writes to stop writing.

        A missing or existing path passes through as itself; any other failure is a :class:`Fault`.
        """
        seconds = self.remote.timeout + size * SECONDS_PER_BYTE
        result: list[Any] = []

        def run() -> None:
            try:
                result.append((True, call(*args)))
            except BaseException as exc:  # handed to the waiting thread
                result.append((False, exc))

        thread = threading.Thread(target=run, name="hatch-aoti-remote", daemon=True)
        thread.start()
        thread.join(seconds)
        if not result:
            if stop is not None:
                stop.set()
            raise Fault(f"no answer within {seconds:.0f} s ({ENV_TIMEOUT})")
        ok, value = result[0]
        if ok:
            return value
        if isinstance(value, (FileNotFoundError, FileExistsError, Fault)):
            raise value
        raise Fault(f"{type(value).__name__}: {value}") from value


def parse_record(raw: bytes, key: str, backend: str) -> dict[str, Any]:
    """A record read from the store, checked: :class:`Damaged` unless it is whole, for ``key`` and
    ``backend``, names only files inside the artifact, and holds an entry the build can use."""
    try:
        record = json.loads(raw)
    except ValueError:
        raise Damaged("its record is not JSON") from None
    if not isinstance(record, dict) or record.get("key") != key:
        raise Damaged("its record is for another key")
    problem = _files_problem(record) or record_problem(record, backend)
    if problem is not None:
        raise Damaged(f"its record {problem}")
    return record


def _files_problem(record: dict[str, Any]) -> str | None:
    files, sizes, executable = record.get("files"), record.get("sizes"), record.get("executable")
    if not isinstance(files, dict) or not files:
        return "lists no files"
    if not isinstance(sizes, dict) or set(sizes) != set(files):
        return "gives its files no sizes"
    for rel, digest in files.items():
        if not inside(rel) or not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            return f"names a file it may not ({rel!r})"
        if type(sizes[rel]) is not int or not 0 <= sizes[rel] <= MAX_FILE_SIZE:
            return f"gives {rel} no size"
    if any(other.startswith(f"{rel}/") for rel in files for other in files):
        return "names a file inside another"
    if not isinstance(executable, list) or not all(isinstance(e, str) and e in files for e in executable):
        return "lists executables it does not hold"
    return None


def _copy(fs: Any, blob: str, target: Path, stop: threading.Event) -> None:
    """Download ``blob`` to ``target`` a MiB at a time, stopping once ``stop`` is set: a transfer given up
    on (timed out) writes nothing more from the thread it was left in."""
    with fs.open(blob, "rb") as src, target.open("wb") as out:
        while not stop.is_set() and (chunk := src.read(1 << 20)):
            out.write(chunk)
    if stop.is_set():
        target.unlink(missing_ok=True)
        raise Fault("given up")


def _place(source: Path, blob: Path) -> None:
    """Copy a file to a name of its own beside ``blob``, then rename it: readers see all of it or none."""
    blob.parent.mkdir(parents=True, exist_ok=True)
    aside = blob.with_name(f"{blob.name}.{uuid.uuid4().hex}.tmp")
    try:
        shutil.copyfile(source, aside)
        os.replace(aside, blob)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)


def _link(data: bytes, path: Path) -> None:
    """Write ``path`` whole if absent: a file of its own, then a hard link (:class:`FileExistsError` if there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        aside.write_bytes(data)
        os.link(aside, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
