"""``weights = "external"``: the weights file fetched once into a per-user cache, verified, then mapped
like a shipped one. Imported only for models whose weights are external, and by ``fetch``."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from typing import Any

from .fetcher import WEIGHTS_TIMEOUT_VARIABLE, Refused, download, out_of_space, problem
from .schema import Entry, External, Weights

#: Where fetched weights files live: this variable, else the platform's cache directory.
WEIGHTS_CACHE_VARIABLE = "HATCH_AOTI_WEIGHTS_CACHE"

__all__ = ["WEIGHTS_CACHE_VARIABLE", "WEIGHTS_TIMEOUT_VARIABLE", "cache_dir", "fetched", "opened", "state"]

#: Bytes hashed at a time.
_CHUNK = 512 << 10

#: Temporary files: created only where nothing is, never through a symbolic link.
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


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
        "cached": _cached(path, external["size"]),
    }


def _cached(path: str, size: int) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _trusted(path, fd, size)
    finally:
        os.close(fd)


def _trusted(path: str, fd: int, size: int) -> bool:
    """The open cached file ``fd`` has the size and modification time it had when it was verified, as
    the stamp beside it, written by the file's owner, says."""
    try:
        st = os.fstat(fd)
        stamp_fd = os.open(f"{path}.verified", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            own = os.fstat(stamp_fd)
            if not stat.S_ISREG(own.st_mode) or own.st_uid != st.st_uid:
                return False
            stamp = json.loads(os.read(stamp_fd, 4096))
        finally:
            os.close(stamp_fd)
    except (OSError, ValueError):
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and isinstance(stamp, dict)
        and stamp.get("size") == st.st_size == size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def _stamp(path: str, fd: int) -> None:
    st = os.fstat(fd)
    part = f"{path}.verified.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):  # left by a process of the same id that died
        os.unlink(part)
    with open(os.open(part, _NEW, 0o644), "w", encoding="utf-8") as f:
        json.dump({"size": st.st_size, "mtime_ns": st.st_mtime_ns}, f)
    os.replace(part, f"{path}.verified")


def fetched(name: str, weights: Weights) -> str:
    """The cached, verified weights file of model ``name``; fetched (and checked) first if it is not."""
    os.close(opened(name, weights))
    return cached_path(weights["external"])


def opened(name: str, weights: Weights) -> int:
    """The cached weights file of model ``name``, open, and verified through that open file (its stamp,
    else its hash), so that what is mapped from it is what was checked, whatever is renamed onto its
    path meanwhile; fetched (and checked) first if it is not in the cache."""
    external, sha = weights["external"], weights["sha256"]
    path = cached_path(external)
    directory = os.path.dirname(path)
    owner = _usable(name, directory)
    fd = _verified(path, external["size"], sha, stamp=owner)
    if fd is not None:
        return fd
    url = source_url(name, external)
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise RuntimeError(
            f"compiled model {name!r}: its weights are not in the cache ({path}) and HF_HUB_OFFLINE is set; "
            f"they come from {url}: fetch them beforehand with `python -m {_package()} fetch {name}` on a "
            f"machine that is online, or copy the file there"
        )
    if not owner:
        raise RuntimeError(
            f"compiled model {name!r}: its weights are not in the cache {directory}, which belongs to another "
            f"user (uid {os.stat(directory).st_uid}), who fetches into it: ask them to run `python -m "
            f"{_package()} fetch {name}`, or set {WEIGHTS_CACHE_VARIABLE} to a directory of your own"
        )
    try:
        with _locked(os.path.join(directory, f"{external['file']}.lock")):
            fd = _verified(path, external["size"], sha)  # fetched meanwhile
            if fd is not None:
                return fd
            for stale in (path, f"{path}.verified"):  # not the file this wheel was built with: never used
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)
            fd = _download(name, url, path, external["size"], sha)
            try:
                _stamp(path, fd)
            except BaseException:
                os.close(fd)
                raise
            return fd
    except RuntimeError:
        raise
    except OSError as exc:
        raise RuntimeError(_disk_problem(name, directory, external["size"], exc)) from None


def _usable(name: str, directory: str) -> bool:
    """Check the cache directory (created 0700 if it is missing) before anything in it is trusted; whether
    this user owns it (and fetches into it), rather than reads another user's."""
    try:
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700, exist_ok=True)
        why = untrusted(directory)
    except OSError as exc:
        raise RuntimeError(_disk_problem(name, directory, 0, exc)) from None
    if why:
        raise RuntimeError(
            f"compiled model {name!r}: the weights cache {directory} cannot be trusted: {why}; "
            f"or set {WEIGHTS_CACHE_VARIABLE} to a directory of your own"
        )
    return os.stat(directory).st_uid == os.getuid()


def untrusted(directory: str) -> str | None:
    """Why the weights cache ``directory`` must not be used, or ``None``: as the compile cache and ssh
    treat theirs, whoever can write it or replace it could swap the weights every load maps (and a
    verified stamp spares the hashing). Its owner may be another user, whose fetches it then serves."""
    info = os.stat(directory)
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users can write to it (mode {stat.S_IMODE(info.st_mode):o}); run `chmod go-w {directory}`"
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    while True:
        above = os.stat(parent)
        if above.st_uid not in (os.getuid(), 0, info.st_uid):
            return f"{parent} above it belongs to another user (uid {above.st_uid})"
        if above.st_mode & stat.S_IWOTH and not above.st_mode & stat.S_ISVTX:
            return f"anyone can replace it: {parent} above it is world-writable without the sticky bit"
        if parent == os.path.dirname(parent):
            return None
        parent = os.path.dirname(parent)


def _verified(path: str, size: int, sha: str, stamp: bool = True) -> int | None:
    """The cached file, open, if it is the right one: stamped as verified, or hashed now through the same
    open file (and stamped, where ``stamp`` and the cache allow). A wrong one is removed only under the
    lock, by the fetch."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size == size:
            if _trusted(path, fd, size):
                return fd
            if _digest_of(fd) == sha:
                if stamp:
                    with contextlib.suppress(OSError):  # a read-only cache (an image's mirror): hashed each time
                        _stamp(path, fd)
                return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _disk_problem(name: str, directory: str, size: int, exc: OSError) -> str:
    where = f"compiled model {name!r}: cannot store its weights in {directory}"
    if out_of_space(exc):
        need = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
        return f"{where}: not enough disk space or quota ({need} needed); free some, or set {WEIGHTS_CACHE_VARIABLE}"
    return f"{where} ({exc.strerror or exc}); set {WEIGHTS_CACHE_VARIABLE} to a writable directory"


class _locked:
    """An exclusive lock on ``path`` (between processes) for as long as the ``with`` lasts."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        import errno
        import fcntl

        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            os.unlink(self.path)  # a symbolic link where the lock goes: never followed
            self.fd = os.open(self.path, flags | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # releases the lock


def _digest_of(fd: int, hasher: Any = None) -> str:
    """The sha256 of the open file ``fd``, read from its start."""
    import hashlib

    hasher = hasher or hashlib.sha256()
    buffer = memoryview(bytearray(_CHUNK))
    offset = 0
    while length := os.preadv(fd, [buffer], offset):
        hasher.update(buffer[:length])
        offset += length
    return str(hasher.hexdigest())


def _open_part(part: str) -> int:
    """The partial file, to resume: one this user wrote (a regular file, not a link to another), else a
    new one, created where nothing is."""
    try:
        fd = os.open(part, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        pass
    except OSError:  # a symbolic link (ELOOP), say: removed, never followed
        os.unlink(part)
    else:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_nlink == 1:
            return fd
        os.close(fd)
        os.unlink(part)
    return os.open(part, (_NEW & ~os.O_WRONLY) | os.O_RDWR, 0o644)


def _download(name: str, url: str, path: str, size: int, sha: str) -> int:
    """Fetch ``url`` into ``path``: resumed where an earlier fetch stopped (HTTP Range), hashed as it is
    written, and renamed into place only once its size and sha256 are the ones the wheel records; the
    file, open."""
    import hashlib

    part = f"{path}.part"
    fd = _open_part(part)
    try:
        have = os.fstat(fd).st_size
        if have > size:
            os.ftruncate(fd, 0)
            have = 0
        hashed = [hashlib.sha256()]
        if have:
            _digest_of(fd, hashed[0])
        if have < size:  # else all of it came before: only the check is left
            try:
                have = download(name, url, fd, size, hashed, path)
            except RuntimeError:
                raise
            except Exception as exc:
                if isinstance(exc, OSError) and not isinstance(exc, Refused) and _local_fault(exc):
                    if out_of_space(exc):  # the partial file is what filled the disk: not kept to resume from
                        with contextlib.suppress(OSError):
                            os.remove(part)
                    raise
                if isinstance(exc, Refused):  # nothing the server sent this time is kept
                    with contextlib.suppress(OSError):
                        os.remove(part)
                raise RuntimeError(problem(name, url, exc)) from None
        digest = hashed[0].hexdigest()
        if have != size or digest != sha:
            os.remove(part)
            got = f"{have} bytes" if have != size else f"sha256 {digest}"
            raise RuntimeError(
                f"compiled model {name!r}: the weights fetched from {url} are not the ones it was built with "
                f"(expected {size} bytes with sha256 {sha}, got {got}); the download was removed. Check that the "
                f"URL serves the file the build wrote, or set HATCH_AOTI_WEIGHTS_URL_{name.upper()} to one that does"
            )
        os.replace(part, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _local_fault(exc: OSError) -> bool:
    import errno
    import urllib.error

    if isinstance(exc, urllib.error.URLError):
        return False
    return out_of_space(exc) or exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM)


def _package() -> str:
    """The loader's import name, for the command that fetches beforehand (``python -m <package>.<loader>``)."""
    return __name__.rpartition(".")[0]
