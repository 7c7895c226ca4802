"""Reproducible anywhere: a second build that varies everything but the sources gives the same bytes.

As reprotest does it: the second build runs in another project directory, with another
torch install (the test venv's rather than an isolated build environment's), another
Inductor cache, temp dir, umask, locale and time zone, one thread instead of the
machine's, both models compiled in one process rather than two, and an empty compile
cache, so it compiles everything again. Only ``SOURCE_DATE_EPOCH`` is shared (the
session sets it).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, copy_project, run

pytestmark = pytest.mark.integration


def test_a_build_varying_paths_env_and_umask_is_byte_identical(sample_dists: tuple[Path, Path], tmp_path: Path) -> None:
    project = copy_project(REPO / "sample_project", tmp_path / "elsewhere" / "the project")
    (tmp_path / "tmp").mkdir()
    env = {
        **os.environ,
        "HATCH_AOTI_CACHE_DIR": str(tmp_path / "empty-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TMPDIR": str(tmp_path / "tmp"),
        "LC_ALL": "C.UTF-8",
        "LANG": "C.UTF-8",
        "TZ": "Pacific/Kiritimati",
        "OMP_NUM_THREADS": "1",
        "HATCH_AOTI_JOBS": "1",
    }
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(tmp_path / "dist"), str(project)]
    proc = run(["bash", "-c", f"umask 077 && exec {shlex.join(build)}"], env=env, cwd=project)
    assert "compiled in" in proc.stderr and "from cache" not in proc.stderr, "the second build must compile"
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    first = sample_dists[1]
    assert wheel.name == first.name
    if wheel.read_bytes() != first.read_bytes():
        raise AssertionError(f"wheels differ: {differences(first, wheel)}")
    assert hashlib.sha256(wheel.read_bytes()).digest() == hashlib.sha256(first.read_bytes()).digest()


def differences(a: Path, b: Path) -> list[str]:
    """Which members of two wheels differ, in content or zip metadata."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        infos_a = {i.filename: i for i in za.infolist()}
        infos_b = {i.filename: i for i in zb.infolist()}
        out = [f"only in one: {name}" for name in sorted(set(infos_a) ^ set(infos_b))]
        for name in sorted(set(infos_a) & set(infos_b)):
            ia, ib = infos_a[name], infos_b[name]
            if za.read(name) != zb.read(name):
                out.append(f"content: {name}")
            if (ia.date_time, ia.external_attr) != (ib.date_time, ib.external_attr):
                out.append(
                    f"metadata: {name} {ia.date_time} {oct(ia.external_attr >> 16)} / "
                    f"{ib.date_time} {oct(ib.external_attr >> 16)}"
                )
    return out
