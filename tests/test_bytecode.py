"""The worker's bytecode store: what isolated builds reuse instead of compiling torch again."""

from __future__ import annotations

import json
import marshal
import os
import py_compile
import subprocess
import sys
import textwrap
from pathlib import Path

MODULE = """
    def fail():
        raise ValueError("from the module")
"""


def import_with_store(where: Path, store: Path) -> dict:
    """Import ``demo_mod`` from ``where`` in a fresh interpreter routed through ``store``."""
    code = textwrap.dedent(
        f"""
        import json, sys, traceback
        from pathlib import Path
        from hatch_aoti.worker.bytecode import install
        install(Path({str(store)!r}))
        sys.path.insert(0, {str(where)!r})
        import demo_mod
        try:
            demo_mod.fail()
        except ValueError as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            message = str(exc)
        print(json.dumps({{"file": demo_mod.fail.__code__.co_filename, "traceback": frame.filename,
                          "line": frame.line, "message": message}}))
        """
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def entries(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*") if p.is_file()) if store.exists() else []


def write_module(where: Path) -> Path:
    where.mkdir(parents=True)
    path = where / "demo_mod.py"
    path.write_text(textwrap.dedent(MODULE), encoding="utf-8")
    return path


def test_compiled_once_then_reused_from_another_location(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = write_module(tmp_path / "env1")
    assert import_with_store(first.parent, store)["file"] == str(first)
    (entry,) = entries(store)
    stamp = entry.stat().st_mtime_ns
    second = write_module(tmp_path / "env2")  # same bytes, new path: a new isolated build env
    result = import_with_store(second.parent, store)
    assert entries(store) == [entry] and entry.stat().st_mtime_ns == stamp, "reused, not rewritten"
    assert result["file"] == result["traceback"] == str(second), "code names the file it came from"
    assert result["line"] == 'raise ValueError("from the module")'


def test_changed_source_gets_its_own_entry(tmp_path: Path) -> None:
    store = tmp_path / "store"
    path = write_module(tmp_path / "env")
    import_with_store(path.parent, store)
    path.write_text(textwrap.dedent(MODULE).replace("from the module", "changed"), encoding="utf-8")
    assert import_with_store(path.parent, store)["line"] == 'raise ValueError("changed")'
    assert len(entries(store)) == 2


def test_damaged_entry_is_compiled_again(tmp_path: Path) -> None:
    store = tmp_path / "store"
    path = write_module(tmp_path / "env")
    import_with_store(path.parent, store)
    (entry,) = entries(store)
    good = entry.read_bytes()
    other = compile(textwrap.dedent(MODULE).replace("from the module", "stale"), str(path), "exec")
    entry.write_bytes(good[:32] + marshal.dumps(other))  # loadable code, but not what was stored
    assert import_with_store(path.parent, store)["message"] == "from the module"
    assert entry.read_bytes() == good, "the damaged entry was replaced"
    entry.write_bytes(good[: len(good) // 2])  # a torn write
    assert import_with_store(path.parent, store)["message"] == "from the module"
    assert entry.read_bytes() == good


def test_modules_with_bytecode_import_as_usual(tmp_path: Path) -> None:
    store = tmp_path / "store"
    path = write_module(tmp_path / "env")
    py_compile.compile(str(path))
    import_with_store(path.parent, store)
    assert entries(store) == []


def test_unusable_store_only_costs_time(tmp_path: Path) -> None:
    blocker = tmp_path / "store"
    blocker.write_text("not a directory")
    path = write_module(tmp_path / "env")
    assert import_with_store(path.parent, blocker)["file"] == str(path)
