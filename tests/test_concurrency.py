"""Concurrent builds sharing one cache, and builds killed with SIGKILL at different points."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import write_project

from hatch_aoti.pipeline.core import _stage_prefix
from hatch_aoti.store.cache import CompileCache

pytestmark = pytest.mark.integration

MODELS = """
    import torch
    from torch import nn

    def _net(seed, width):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(width, 3), nn.Tanh())

    def shared():
        return _net(0, 4)

    def {own}():
        return _net({seed}, 5)
"""
#: Packed as real-size models are by default: their wheels must be reproducible too.
HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti.models.shared]
    factory = "{pkg}.models:shared"
    inputs = [{{ shape = [2, 4] }}]
    inductor-configs = {{ "cpp.weight_prepack" = true }}

    [tool.hatch.build.targets.wheel.hooks.aoti.models.{own}]
    factory = "{pkg}.models:{own}"
    inputs = [{{ shape = [2, 5] }}]
    inductor-configs = {{ "cpp.weight_prepack" = true }}
"""


def project(root: Path, pkg: str, own: str, seed: int) -> Path:
    hook = HOOK.format(pkg=pkg, own=own)
    return write_project(root, pkg, hook, {"models.py": MODELS.format(own=own, seed=seed)})


def start_build(root: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(root / "dist"), str(root)]
    return subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen[str]) -> str:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    return output


def wheel_of(root: Path) -> bytes:
    (wheel,) = (root / "dist").glob("*.whl")
    return wheel.read_bytes()


def intact_entries(cache: CompileCache, tmp_path: Path) -> int:
    """How many entries the cache holds; each one must pass its checks."""
    entries = cache.entries()
    for entry in entries:
        assert cache.lookup(entry.name, tmp_path / "check" / entry.name) is not None, f"{entry} is damaged"
    return len(entries)


def test_concurrent_builds_share_one_cache(tmp_path: Path) -> None:
    """The same project twice and another sharing one of its models, at once, twice over."""
    cache = CompileCache(tmp_path / "cache")
    env = {**os.environ, "HATCH_AOTI_CACHE_DIR": str(cache.root), "HATCH_AOTI_JOBS": "1"}
    for round_ in ("cold", "warm"):
        roots = [
            project(tmp_path / round_ / "p1", "onepkg", "alpha", 1),
            project(tmp_path / round_ / "p1 copy", "onepkg", "alpha", 1),
            project(tmp_path / round_ / "p2", "twopkg", "beta", 2),
        ]
        outputs = [finish(p) for p in [start_build(root, env) for root in roots]]
        if round_ == "warm":
            assert all(o.count("from cache in") == 2 for o in outputs), outputs
        assert wheel_of(roots[0]) == wheel_of(roots[1]), "the same sources, the same bytes"
        assert intact_entries(cache, tmp_path / round_) == 3, "one entry per model: shared, alpha, beta"
        assert not list((cache.root / "v2" / "tmp").iterdir()), "nothing half-written stays"


def marked(marker: str) -> list[int]:
    """Processes whose environment carries ``marker``: the build and everything it started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_builds_killed_at_any_point_leave_nothing_a_later_build_accepts(tmp_path: Path) -> None:
    """SIGKILL the frontend and backend at ten points of a build, the compile included.

    Each time the coordinator, its helpers and their compilers stop within seconds, no
    cache entry is damaged, staging is left only where the next build (or
    ``hatch build --clean``) removes it, and the next build succeeds.
    """
    root = project(tmp_path / "proj", "killpkg", "own", 3)
    cache = CompileCache(tmp_path / "cache")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = f"HATCH_AOTI_TEST_BUILD={uuid.uuid4().hex}"
    env = {
        **os.environ,
        "HATCH_AOTI_CACHE_DIR": str(cache.root),
        "TMPDIR": str(tmp),
        "HATCH_AOTI_JOBS": "2",
        marker.split("=")[0]: marker.split("=")[1],
    }

    def staged(*parts: str) -> Callable[[], bool]:
        return lambda: any(p.joinpath(*parts).exists() for p in tmp.glob(f"{_stage_prefix(root)}*"))

    # (when to kill, whether the compile cache is emptied first so that the build compiles)
    points: list[tuple[str, Callable[[], bool], float, bool]] = [
        ("at once", lambda: True, 0.0, True),
        ("staging made", staged(), 0.0, True),
        ("coordinator starting", staged("coordinator.log"), 0.3, True),
        ("compiling", staged("inductor"), 0.5, True),
        ("compile helper running", staged("helper-1", "helper.log"), 1.0, True),
        ("deep in the compile", staged("inductor"), 3.5, True),
        ("verifying, caching", staged("package", "_aoti", "shared"), 0.0, True),
        ("a cached rebuild", staged("coordinator.log"), 1.0, False),
        ("a cached rebuild, late", staged("package", "_aoti", "own"), 0.0, False),
        ("writing the wheel", lambda: any(root.glob("dist/*")), 0.0, False),
    ]
    killed = []
    for label, ready, delay, cold in points:
        if cold:
            shutil.rmtree(cache.root / "v2" / "entries", ignore_errors=True)
        shutil.rmtree(root / "dist", ignore_errors=True)
        proc = start_build(root, env)
        assert wait_for(lambda: ready() or proc.poll() is not None, 120), label
        time.sleep(delay)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the frontend and the build backend
            killed.append(label)
        proc.wait()
        assert wait_for(lambda: not marked(marker), 15), f"{label}: build processes outlived the build"
        intact_entries(cache, tmp_path / "checks" / label.replace(" ", "-"))
        leftovers = [p for p in tmp.iterdir() if p.name.startswith("hatch-aoti-")]
        assert all(p.name.startswith(_stage_prefix(root)) for p in leftovers), leftovers

    assert len(killed) >= 8, f"only these points were reached before the build ended: {killed}"
    output = finish(start_build(root, env))
    assert "Successfully built" in output
    assert [p.name for p in tmp.iterdir() if p.name.startswith("hatch-aoti-")] == [], "the next build swept them"
    assert not [p for p in (cache.root / "v2" / "tmp").iterdir()], "and the cache's half-written entries"
