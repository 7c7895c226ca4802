"""``weights = "external"``: the weights file fetched once into a per-user cache, verified, then mapped
like a shipped one. Imported only for models whose weights are external, and by ``fetch``."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any

from .schema import Entry, External, Weights

#: Where fetched weights files live: this variable, else the platform's cache directory.
WEIGHTS_CACHE_VARIABLE = "HATCH_AOTI_WEIGHTS_CACHE"


#: Seconds a fetch may wait for the server at a time (connecting, or for the next bytes).
WEIGHTS_TIMEOUT_VARIABLE = "HATCH_AOTI_WEIGHTS_TIMEOUT"


#: Bytes read, hashed and written at a time: small enough to stay in the CPU's cache between the
#: three (4 MiB chunks made a loopback fetch two to three times slower).
_CHUNK = 512 << 10


def cache_dir() -> str:
    root = os.environ.get(WEIGHTS_CACHE_VARIABLE)
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hatch-aoti", "weights")


def source_url(name: str, external: External) -> str:
    override = os.environ.get(f"HATCH_AOTI_WEIGHTS_URL_{name.upper()}")
    return str(override or external["url"]).replace("{file}", external["file"])


def cached_path(external: External) -> str:
    return os.path.join(cache_dir(), external["file"])


def state(name: str, entry: Entry) -> dict[str, Any] | None:
    """Where an external model's weights come from and whether they are in the cache (``info()``, the CLI)."""
    weights = entry.get("weights", {})
    external = weights.get("external")
    if external is None:
        return None
    path = cached_path(external)
    return {
        "url": source_url(name, external),
        "size": external["size"],
        "sha256": weights["sha256"],
        "path": path,
        "cached": _trusted(path, external["size"]),
    }


def _trusted(path: str, size: int) -> bool:
    """A cached file whose size and modification time are those it had when it was verified."""
    try:
        with open(f"{path}.verified", encoding="utf-8") as f:
            stamp = json.load(f)
        st = os.stat(path)
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict) and stamp.get("size") == st.st_size == size and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def _stamp(path: str) -> None:
    st = os.stat(path)
    part = f"{path}.verified.{os.getpid()}"
    with open(part, "w", encoding="utf-8") as f:
        json.dump({"size": st.st_size, "mtime_ns": st.st_mtime_ns}, f)
    os.replace(part, f"{path}.verified")


def fetched(name: str, weights: Weights) -> str:
    """The cached, verified weights file of model ``name``; fetched (and checked) first if it is not."""
    external, sha = weights["external"], weights["sha256"]
    path = cached_path(external)
    directory = os.path.dirname(path)
    if _trusted(path, external["size"]) or _right_in_place(path, sha):
        return path
    url = source_url(name, external)
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise RuntimeError(
            f"compiled model {name!r}: its weights are not in the cache ({path}) and HF_HUB_OFFLINE is set; "
            f"they come from {url}: fetch them beforehand with `python -m {_package()} fetch {name}` on a "
            f"machine that is online, or copy the file there"
        )
    try:
        os.makedirs(directory, exist_ok=True)
        with _locked(os.path.join(directory, f"{external['file']}.lock")):
            if _trusted(path, external["size"]) or _right_in_place(path, sha):  # fetched meanwhile
                return path
            for stale in (path, f"{path}.verified"):  # not the file this wheel was built with: never used
                if os.path.exists(stale):
                    os.remove(stale)
            _download(name, url, path, external["size"], sha)
            _stamp(path)
            return path
    except RuntimeError:
        raise
    except OSError as exc:
        raise RuntimeError(_disk_problem(name, directory, external["size"], exc)) from None


def _right_in_place(path: str, sha: str) -> bool:
    """A cached file not known to be verified (copied in by hand, or changed since): hashed now, and
    trusted from now on if it is right. A wrong one is removed only under the lock, by the fetch."""
    if not os.path.exists(path) or _digest_of(path) != sha:
        return False
    with contextlib.suppress(OSError):  # a read-only cache (an image's mirror): checked again next time
        _stamp(path)
    return True


def _disk_problem(name: str, directory: str, size: int, exc: OSError) -> str:
    where = f"compiled model {name!r}: cannot store its weights in {directory}"
    if _out_of_space(exc):
        need = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
        return f"{where}: not enough disk space or quota ({need} needed); free some, or set {WEIGHTS_CACHE_VARIABLE}"
    return f"{where} ({exc.strerror or exc}); set {WEIGHTS_CACHE_VARIABLE} to a writable directory"


class _locked:
    """An exclusive lock on ``path`` (between processes) for as long as the ``with`` lasts."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # releases the lock


def _digest_of(path: str, hasher: Any = None) -> str:
    import hashlib

    hasher = hasher or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return str(hasher.hexdigest())


def _download(name: str, url: str, path: str, size: int, sha: str) -> None:
    """Fetch ``url`` into ``path``: resumed where an earlier fetch stopped (HTTP Range), hashed as it is
    written, and renamed into place only once its size and sha256 are the ones the wheel records."""
    import hashlib
    import urllib.parse
    import urllib.request

    part = f"{path}.part"
    hasher = hashlib.sha256()
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have > size:
        os.remove(part)
        have = 0
    if have:
        _digest_of(part, hasher)
    request = urllib.request.Request(url, headers={"User-Agent": "hatch-aoti-loader"})
    host = urllib.parse.urlsplit(url).hostname or ""
    token = os.environ.get("HF_TOKEN")
    if token and (host == "huggingface.co" or host.endswith(".huggingface.co")):
        request.add_unredirected_header("Authorization", f"Bearer {token}")  # not to the CDN it redirects to
    if have:
        request.add_header("Range", f"bytes={have}-")
    if have < size:  # else all of it came before: only the check is left
        try:
            with urllib.request.urlopen(request, timeout=_timeout()) as response:
                if have and getattr(response, "status", 200) != 206:  # the server sends it all again
                    have, hasher = 0, hashlib.sha256()
                with open(part, "ab" if have else "wb") as out:
                    have += _copy_hashing(response, out, hasher)
        except Exception as exc:
            if _local_fault(exc):  # the cache's disk, not the server
                if _out_of_space(exc):  # the partial file is what filled the disk: not kept to resume from
                    with contextlib.suppress(OSError):
                        os.remove(part)
                raise
            raise RuntimeError(_fetch_problem(name, url, exc)) from None
    if have < size:  # the server stopped early: what came is kept for the next try to resume from
        raise RuntimeError(
            _fetch_problem(name, url, ConnectionError(f"the connection closed after {have} of {size} bytes"))
        )
    if have != size or hasher.hexdigest() != sha:
        os.remove(part)
        got = f"{have} bytes" if have != size else f"sha256 {hasher.hexdigest()}"
        raise RuntimeError(
            f"compiled model {name!r}: the weights fetched from {url} are not the ones it was built with "
            f"(expected {size} bytes with sha256 {sha}, got {got}); the download was removed. Check that the "
            f"URL serves the file the build wrote, or set HATCH_AOTI_WEIGHTS_URL_{name.upper()} to one that does"
        )
    os.replace(part, path)


def _timeout() -> float:
    text = os.environ.get(WEIGHTS_TIMEOUT_VARIABLE) or "30"
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise RuntimeError(f"{WEIGHTS_TIMEOUT_VARIABLE}={text!r}: expected a number of seconds above 0")
    return value


def _copy_hashing(source: Any, out: Any, hasher: Any) -> int:
    """Copy ``source`` to ``out``, hashing the bytes on the way; the hashing and writing run in a thread
    beside the reading (all three release the GIL), so the bytes are gone over once, at the network's
    pace. Buffers are reused in turn: the bytes are read into them, not copied out."""
    import queue

    buffers = [memoryview(bytearray(_CHUNK)) for _ in range(4)]
    free: queue.Queue[memoryview] = queue.Queue()
    for buffer in buffers:
        free.put(buffer)
    filled: queue.Queue[tuple[memoryview, int] | None] = queue.Queue()
    failed: list[BaseException] = []

    def drain() -> None:
        while (item := filled.get()) is not None:
            buffer, length = item
            if not failed:
                try:
                    hasher.update(buffer[:length])
                    out.write(buffer[:length])
                except BaseException as exc:  # a full disk, say: raised in the reading thread
                    failed.append(exc)
            free.put(buffer)

    writer = threading.Thread(target=drain, name="hatch-aoti-fetch", daemon=True)
    writer.start()
    copied = 0
    try:
        while not failed:
            buffer = free.get()
            length = source.readinto(buffer)
            if not length:
                free.put(buffer)
                break
            filled.put((buffer, length))
            copied += length
    finally:
        filled.put(None)
        writer.join()
    if failed:
        raise failed[0]
    return copied


def _out_of_space(exc: Exception) -> bool:
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _local_fault(exc: Exception) -> bool:
    import errno
    import urllib.error

    if not isinstance(exc, OSError) or isinstance(exc, urllib.error.URLError):
        return False
    return _out_of_space(exc) or exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM)


def _fetch_problem(name: str, url: str, exc: Exception) -> str:
    import urllib.error

    where = f"compiled model {name!r}: cannot fetch its weights from {url}"
    if isinstance(exc, urllib.error.HTTPError):
        hint = " (a gated or private repository needs HF_TOKEN)" if exc.code in (401, 403) else ""
        return (
            f"{where}: HTTP {exc.code} {exc.reason}{hint}; check the URL, or set HATCH_AOTI_WEIGHTS_URL_{name.upper()}"
        )
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, TimeoutError) or "timed out" in str(reason):
        reason = f"no answer within {_timeout():g} s ({WEIGHTS_TIMEOUT_VARIABLE})"
    return (
        f"{where}: {reason}. Offline? Fetch them beforehand with `python -m {_package()} fetch {name}`, or set "
        f"HATCH_AOTI_WEIGHTS_URL_{name.upper()} to a mirror; an interrupted fetch resumes where it stopped"
    )


def _package() -> str:
    """The loader's import name, for the command that fetches beforehand (``python -m <package>.<loader>``)."""
    return __name__.rpartition(".")[0]
