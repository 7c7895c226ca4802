"""A content-addressed bytecode store for the worker's own imports.

Isolated builds (``python -m build``, ``pip wheel``) install torch into a fresh build
environment without compiling its ``.py`` files, so every worker would compile torch's
export stack from source on every build (figures in docs/performance.md). The worker
keeps compiled code objects in the compile cache, keyed by the digest of each source
file's bytes (with the interpreter's bytecode magic number and optimisation level), so a
build in a new environment with the same torch finds them.

Only modules Python would compile from source are affected (those without a ``.pyc``
beside them); everything else imports as usual. Entries are written atomically and
carry a checksum: a damaged entry is compiled again and replaced, never run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery as machinery
import importlib.util
import marshal
import os
import sys
import types
import uuid
from pathlib import Path

_DIGEST_SIZE = 32


def install(store: Path) -> None:
    """Route source imports of this process through ``store``."""
    loader = type("_CachingSourceLoader", (_CachingSourceLoader,), {"store": store})
    hook = machinery.FileFinder.path_hook(
        (machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
        (loader, machinery.SOURCE_SUFFIXES),
        (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES),
    )
    sys.path_hooks.insert(0, hook)
    sys.path_importer_cache.clear()


class _CachingSourceLoader(machinery.SourceFileLoader):
    store: Path

    def get_code(self, fullname: str) -> types.CodeType | None:
        path = self.get_filename(fullname)
        try:
            if os.path.exists(importlib.util.cache_from_source(path)):
                return super().get_code(fullname)  # a .pyc is there: Python's own rules apply
        except NotImplementedError:  # no cache tag (sys.implementation.cache_tag is None)
            return super().get_code(fullname)
        source = self.get_data(path)
        entry = self.store / _key(source)
        code = _read(entry, path)
        if code is None:
            code = self.source_to_code(source, path)
            _write(entry, code)
        return code


def _key(source: bytes) -> str:
    digest = hashlib.sha256(importlib.util.MAGIC_NUMBER + bytes([sys.flags.optimize]) + source).hexdigest()
    return f"{digest[:2]}/{digest}"


def _read(entry: Path, path: str) -> types.CodeType | None:
    try:
        data = entry.read_bytes()
    except OSError:
        return None
    payload = data[_DIGEST_SIZE:]
    if len(data) <= _DIGEST_SIZE or hashlib.sha256(payload).digest() != data[:_DIGEST_SIZE]:
        return None
    try:
        code = marshal.loads(payload)
    except (EOFError, ValueError, TypeError):
        return None
    if not isinstance(code, types.CodeType):
        return None
    return code if code.co_filename == path else _relocate(code, path)


def _relocate(code: types.CodeType, path: str) -> types.CodeType:
    """The same code, naming the file it was imported from (tracebacks, ``inspect``)."""
    consts = tuple(_relocate(c, path) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=path, co_consts=consts)


def _write(entry: Path, code: types.CodeType) -> None:
    payload = marshal.dumps(code)
    tmp = entry.with_name(f"{entry.name}.{uuid.uuid4().hex}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, entry)
    except OSError:  # a read-only or full cache only costs time
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
