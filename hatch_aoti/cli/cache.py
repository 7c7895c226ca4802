"""``hatch-aoti cache info | prune | clear``: the compile cache builds share, and the bytecode store in it."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from hatch_aoti.cli.output import Output, human_size
from hatch_aoti.cli.target import CliError
from hatch_aoti.store import cache, remote


def store(max_size: str | None = None) -> cache.CompileCache:
    """The cache builds in this environment use (``HATCH_AOTI_CACHE_DIR``, ``HATCH_AOTI_CACHE_MAX_SIZE``);
    ``max_size`` replaces the cap from the environment."""
    env = dict(os.environ)
    if max_size is not None:
        try:
            cap = cache.parse_size(max_size)
        except ValueError:
            raise CliError(
                f"--max-size must be a size such as 20GB, 512MB or a number of bytes, not {max_size!r}"
            ) from None
        env[cache.ENV_MAX_SIZE] = str(cap)
    try:
        return cache.configured(env)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def info(out: Output) -> int:
    compile_cache = store()
    now = time.time()
    entries = [_describe(d, r, now - used) for d, r, used in sorted(compile_cache.records(), key=lambda x: -x[2])]
    bytecode = _usage(compile_cache.root / cache.BYTECODE_DIR)
    data = {
        "root": str(compile_cache.root),
        "untrusted": cache.untrusted(compile_cache.root),
        "max_size": compile_cache.max_size,
        "size": sum(e["size"] for e in entries),
        "entries": entries,
        "bytecode": {"path": str(compile_cache.root / cache.BYTECODE_DIR), **bytecode},
        "remote": remote_info(),
    }
    out.data(data)
    if out.json:
        return 0
    out.line(
        f"compile cache: {data['root']}, {len(entries)} entries, {human_size(data['size'])} "
        f"of {human_size(data['max_size'])} ({cache.ENV_MAX_SIZE})"
    )
    if data["untrusted"]:
        out.line(f"builds do not use it: {data['untrusted']}", style="red")
    rows = [
        [e["key"][:16], e["backend"], e["device"], human_size(e["size"]), _age(e["last_used_s_ago"])] for e in entries
    ]
    out.table(["key", "backend", "device", "size", "last used"], rows)
    out.line(
        f"bytecode store: {data['bytecode']['path']}, {bytecode['files']} files, {human_size(bytecode['size'])} "
        "(delete it at any time)"
    )
    _print_remote(out, data["remote"])
    return 0


def remote_info() -> dict[str, Any] | None:
    """The remote tier builds here use, and what it holds; ``None`` if the environment names none."""
    try:
        settings = remote.from_env()
    except ValueError as exc:
        return {"url": os.environ.get(remote.ENV_URL), "problem": str(exc)}
    if settings is None:
        return None
    data: dict[str, Any] = {"url": settings.url, "mode": settings.mode, "timeout_s": settings.timeout}
    if cache.disabled():
        data["problem"] = f"builds do not use it: {cache.ENV_DISABLE} is set"
        return data
    try:
        data["entries"], data["size"] = remote.RemoteCache(settings).usage()
    except (remote.Fault, FileNotFoundError) as exc:
        data["problem"] = f"cannot read it: {exc}"
    return data


def _print_remote(out: Output, data: dict[str, Any] | None) -> None:
    if data is None:
        out.line(f"remote cache: none ({remote.ENV_URL} is not set)")
        return
    if "entries" in data:
        out.line(
            f"remote cache: {data['url']} ({data['mode']}), {data['entries']} entries, {human_size(data['size'])} "
            "(eviction: the store's own lifecycle rules)"
        )
    else:
        out.line(f"remote cache: {data['url']}")
    if "problem" in data:
        out.line(data["problem"], style="red")


def prune(out: Output, max_size: str | None) -> int:
    compile_cache = store(max_size)
    removed = compile_cache.evict()
    size = _entries_size(compile_cache)
    data = {
        "root": str(compile_cache.root),
        "max_size": compile_cache.max_size,
        "removed": [p.name for p in removed],
        "size": size,
    }
    out.data(data)
    out.line(
        f"removed {len(removed)} entries used longest ago; {human_size(size)} left "
        f"(cap {human_size(compile_cache.max_size)})"
    )
    return 0


def clear(out: Output) -> int:
    compile_cache = store()
    removed, in_use = compile_cache.clear()
    bytecode = compile_cache.root / cache.BYTECODE_DIR
    freed = _usage(bytecode)
    shutil.rmtree(bytecode, ignore_errors=True)
    data = {
        "root": str(compile_cache.root),
        "removed": [p.name for p in removed],
        "in_use": [p.name for p in in_use],
        "bytecode_removed": freed,
    }
    out.data(data)
    out.line(
        f"removed {len(removed)} entries and the bytecode store ({human_size(freed['size'])})"
        + (f"; {len(in_use)} entries in use by a running build were kept" if in_use else "")
    )
    return 0


def _describe(entry_dir: Path, record: dict[str, Any], age: float) -> dict[str, Any]:
    entry = record["entry"] if isinstance(record.get("entry"), dict) else {}
    note = "backend" not in entry and isinstance(entry.get("tuning"), dict)  # a tuning candidate's drop or time
    return {
        "key": entry_dir.name,
        "backend": "tuning note" if note else entry.get("backend", "?"),
        "device": "-" if note else entry.get("device", "?"),
        "size": record["size"],
        "last_used_s_ago": round(age),
    }


def _entries_size(compile_cache: cache.CompileCache) -> int:
    return sum(record["size"] for _, record, _ in compile_cache.records())


def _usage(path: Path) -> dict[str, Any]:
    files, size = cache.tree_usage(path)
    return {"files": files, "size": size}


def _age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"
