"""The HTTP(S) fetch of an external weights file into its partial file: bounded in bytes, redirects and
time, retried as pip and huggingface_hub retry, resumed where it stopped. Used by :mod:`.external` only."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any

#: Seconds a fetch may wait for the server at a time (connecting, or for the next bytes).
WEIGHTS_TIMEOUT_VARIABLE = "HATCH_AOTI_WEIGHTS_TIMEOUT"

#: Bytes read, hashed and written at a time: small enough to stay in the CPU's cache between the
#: three (4 MiB chunks made a loopback fetch two to three times slower).
_CHUNK = 512 << 10

#: Redirects followed at most (the Hub's file URLs take one or two).
MAX_REDIRECTS = 10

#: Seconds waited before each retry of a dropped connection, a 5xx or a 429 (pip's backoff).
_BACKOFF = (0.5, 1.0, 2.0, 4.0)

#: The whole fetch's deadline: this many per-read timeouts, plus one second per MiB (a floor of
#: 1 MiB/s on average), so that a server dripping a byte at a time cannot hold ``load()`` forever.
_DEADLINE_TIMEOUTS = 10
_SLOWEST = 1 << 20

#: A fetch above this says what it fetches, from where and how big (stderr).
_ANNOUNCE = 8 << 20

_HF_HOSTS = ("huggingface.co",)


class Refused(Exception):
    """What the server sent is not what was asked for: never retried, and the partial file is removed."""


class _Retry(Exception):
    """A fault a later try may not meet (a dropped connection, a 5xx, a 429): retried with backoff."""

    def __init__(self, cause: BaseException, wait: float | None = None) -> None:
        super().__init__(str(cause))
        self.cause, self.wait = cause, wait


def timeout() -> float:
    text = os.environ.get(WEIGHTS_TIMEOUT_VARIABLE) or "30"
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise RuntimeError(f"{WEIGHTS_TIMEOUT_VARIABLE}={text!r}: expected a number of seconds above 0")
    return value


def deadline_seconds(size: int) -> float:
    """How long the whole fetch of ``size`` bytes may take, retries included."""
    return _DEADLINE_TIMEOUTS * timeout() + size / _SLOWEST


def token_for(url: str) -> str | None:
    """The Hub token to send with ``url``: only to the Hub itself, and only over https; ``HF_TOKEN``, else
    the one ``hf auth login`` saved (``$HF_TOKEN_PATH``, else ``$HF_HOME/token``)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "https" or not any(host == h or host.endswith(f".{h}") for h in _HF_HOSTS):
        return None
    token = os.environ.get("HF_TOKEN")
    if not token:
        home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        try:
            with open(os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token"), encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, ValueError):
            return None
    return token or None


def ssl_context() -> Any:
    """The default context, with the certificates that ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE`` or
    ``SSL_CERT_FILE`` name (a corporate proxy's), as pip and requests honour them."""
    import ssl

    for variable in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"):
        where = os.environ.get(variable)
        if where:
            try:
                if os.path.isdir(where):
                    return ssl.create_default_context(capath=where)
                return ssl.create_default_context(cafile=where)
            except (OSError, ssl.SSLError) as exc:
                raise RuntimeError(f"{variable}={where!r}: cannot read certificates from it ({exc})") from None
    return ssl.create_default_context()


def download(name: str, url: str, fd: int, size: int, hashed: list[Any], where: str) -> int:
    """Append the bytes of ``url`` still missing to the open partial file ``fd``, whose bytes the hasher
    ``hashed[0]`` has seen (replaced there if the server sends the whole file again), retrying what a
    client should; the bytes the file now holds."""
    started = time.monotonic()
    deadline = started + deadline_seconds(size)
    announce = size > _ANNOUNCE
    if announce:
        print(
            f"{_package()}: fetching the weights of {name!r} ({_mib(size)}) from {url} into {where}",
            file=sys.stderr,
            flush=True,
        )
    tries = 0
    while True:
        try:
            return _once(url, fd, size, hashed, deadline, announce)
        except _Retry as retry:
            wait = _BACKOFF[tries] if tries < len(_BACKOFF) else None
            if wait is not None and retry.wait is not None:
                wait = min(max(wait, retry.wait), 30.0)
            if wait is None or time.monotonic() + wait >= deadline:
                raise retry.cause from None
            tries += 1
            time.sleep(wait)
        finally:
            if announce and sys.stderr.isatty():
                print(file=sys.stderr, flush=True)


def _once(url: str, fd: int, size: int, hashed: list[Any], deadline: float, announce: bool) -> int:
    """One try: follows redirects itself (no body read), checks the answer's length and range, copies."""
    import http.client
    import urllib.error
    import urllib.parse
    import urllib.request

    opener = _opener(url)
    token = token_for(url)
    have = os.fstat(fd).st_size
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        request = urllib.request.Request(current, headers={"User-Agent": "hatch-aoti-loader"})
        if token and current == url:  # the URL given only: never to where it redirects
            request.add_unredirected_header("Authorization", f"Bearer {token}")
        if have:
            request.add_header("Range", f"bytes={have}-")
        wait = min(timeout(), max(deadline - time.monotonic(), 0.001))
        try:
            response = opener.open(request, timeout=wait)
        except urllib.error.HTTPError as exc:
            exc.close()  # its body is never read
            if exc.code >= 500 or exc.code == 429:
                raise _Retry(exc, _retry_after(exc.headers)) from None
            raise
        except (OSError, EOFError, http.client.HTTPException) as exc:
            if _local(exc):
                raise
            raise _Retry(exc) from None
        with response:
            status = getattr(response, "status", None) or 200
            if 300 <= status < 400:
                target = urllib.parse.urljoin(current, response.headers.get("Location") or "")
                if urllib.parse.urlsplit(target).scheme not in ("http", "https"):
                    raise Refused(f"it redirects to {target!r}, which is not http(s)")
                if urllib.parse.urlsplit(current).scheme == "https" and not target.startswith("https:"):
                    raise Refused(f"it redirects from https down to http ({target})")
                current = target
                continue
            return _receive(response, status, fd, size, hashed, have, deadline, announce)
    raise Refused(f"more than {MAX_REDIRECTS} redirects")


def _receive(
    response: Any, status: int, fd: int, size: int, hashed: list[Any], have: int, deadline: float, announce: bool
) -> int:
    import hashlib
    import http.client

    if have and status != 206:  # the server sends it all again
        os.ftruncate(fd, 0)
        have = 0
        hashed[0] = hashlib.new(hashed[0].name)
    elif status == 206:
        start = _range_start(response.headers.get("Content-Range"))
        if start != have:
            raise Refused(
                f"asked for the bytes from {have}, it sent a range from {start} "
                f"({response.headers.get('Content-Range')!r})"
            )
    missing = size - have
    length = response.headers.get("Content-Length")
    if length is not None and (not length.strip().isdigit() or int(length) > missing):
        raise Refused(f"it announces {length} bytes where {missing} are missing")
    os.lseek(fd, 0, os.SEEK_END)
    try:
        copied = _copy_hashing(response, fd, hashed[0], missing, deadline, (have, size) if announce else None)
    except (OSError, EOFError, ValueError, http.client.HTTPException) as exc:
        if _local(exc):
            raise
        raise _Retry(exc) from None
    if have + copied < size:  # the connection closed early: resumed by the next try
        raise _Retry(ConnectionError(f"the connection closed after {have + copied} of {size} bytes"))
    return have + copied


def _range_start(text: str | None) -> int | None:
    """The first byte of a Content-Range (``bytes 100-199/200``), ``None`` if there is none."""
    if not text or not text.startswith("bytes "):
        return None
    first = text[6:].split("-", 1)[0].strip()
    return int(first) if first.isdigit() else None


def _retry_after(headers: Any) -> float | None:
    with contextlib.suppress(AttributeError, TypeError, ValueError):
        return float(headers.get("Retry-After"))
    return None


def _opener(url: str) -> Any:
    """urllib's opener, with redirects handed back as they are (their body unread), for :func:`_once` to
    follow or refuse, and the certificates :func:`ssl_context` names."""
    import urllib.request

    class Unfollowed(urllib.request.HTTPRedirectHandler):
        def http_error_301(self, req: Any, fp: Any, code: int, msg: str, headers: Any) -> Any:
            return fp

        http_error_302 = http_error_303 = http_error_307 = http_error_308 = http_error_301

    handlers: list[Any] = [Unfollowed()]
    if url.startswith("https:"):
        handlers.append(urllib.request.HTTPSHandler(context=ssl_context()))
    return urllib.request.build_opener(*handlers)


def _copy_hashing(
    source: Any, fd: int, hasher: Any, limit: int, deadline: float, progress: tuple[int, int] | None
) -> int:
    """Copy at most ``limit`` bytes of ``source`` to ``fd``, hashing them on the way; the hashing and
    writing run in a thread beside the reading (all three release the GIL), so the bytes are gone over
    once, at the network's pace. Buffers are reused in turn; each is filled by single reads, so that the
    deadline is checked between any two (a slow drip cannot hold a read that fills a whole buffer)."""
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
                    view = buffer[:length]
                    while view:
                        view = view[os.write(fd, view) :]
                except BaseException as exc:  # a full disk, say: raised in the reading thread
                    failed.append(exc)
            free.put(buffer)

    read = getattr(source, "readinto1", None) or source.readinto
    writer = threading.Thread(target=drain, name="hatch-aoti-fetch", daemon=True)
    writer.start()
    copied, shown = 0, 0.0
    try:
        while not failed and copied < limit:
            buffer = free.get()
            want = min(_CHUNK, limit - copied)
            length = 0
            while length < want:
                got = read(buffer[length:want])
                if not got:
                    break
                length += got
                if time.monotonic() > deadline:
                    filled.put((buffer, length))
                    copied += length
                    raise TimeoutError("the whole fetch's deadline passed")
            if not length:
                free.put(buffer)
                break
            filled.put((buffer, length))
            copied += length
            if progress and sys.stderr.isatty() and time.monotonic() - shown > 0.5:
                shown = time.monotonic()
                have, size = progress
                print(f"\r  {_mib(have + copied)} of {_mib(size)}", end="", file=sys.stderr, flush=True)
            if length < want:
                break
    finally:
        filled.put(None)
        writer.join()
    if failed:
        raise failed[0]
    return copied


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"


def out_of_space(exc: BaseException) -> bool:
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _local(exc: BaseException) -> bool:
    """A fault of the cache's disk, not of the server."""
    import errno
    import urllib.error

    if not isinstance(exc, OSError) or isinstance(exc, urllib.error.URLError):
        return False
    return out_of_space(exc) or exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM)


def problem(name: str, url: str, exc: BaseException) -> str:
    """The message of a fetch that failed: the model, the URL, the reason and the way out."""
    import urllib.error

    where = f"compiled model {name!r}: cannot fetch its weights from {url}"
    if isinstance(exc, Refused):
        return f"{where}: refused: {exc}; the partial download was removed"
    if isinstance(exc, urllib.error.HTTPError):
        hint = " (a gated or private repository needs HF_TOKEN)" if exc.code in (401, 403) else ""
        return (
            f"{where}: HTTP {exc.code} {exc.reason}{hint}; check the URL, or set HATCH_AOTI_WEIGHTS_URL_{name.upper()}"
        )
    reason: Any = getattr(exc, "reason", None) or exc
    if "deadline" in str(reason):
        reason = f"it took more than {deadline_seconds(0):g} s plus 1 s per MiB ({WEIGHTS_TIMEOUT_VARIABLE})"
    elif isinstance(reason, TimeoutError) or "timed out" in str(reason):
        reason = f"no answer within {timeout():g} s ({WEIGHTS_TIMEOUT_VARIABLE})"
    return (
        f"{where}: {reason}. Offline? Fetch them beforehand with `python -m {_package()} fetch {name}`, or set "
        f"HATCH_AOTI_WEIGHTS_URL_{name.upper()} to a mirror; an interrupted fetch resumes where it stopped"
    )


def _package() -> str:
    """The loader's import name, for the command that fetches beforehand (``python -m <package>.<loader>``)."""
    return __name__.rpartition(".")[0]
