"""Two builds of the same sources give byte-identical wheels."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO, copy_project, run

pytestmark = pytest.mark.integration


def test_two_cold_builds_are_byte_identical(tmp_path: Path) -> None:
    project = copy_project(REPO / "sample_project", tmp_path / "sample_project")
    inductor = tmp_path / "inductor-cache"
    digests = []
    for attempt in range(2):
        shutil.rmtree(inductor, ignore_errors=True)  # cold torch caches, at the same path
        env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000", "HATCH_AOTI_NO_CACHE": "1",
               "TORCHINDUCTOR_CACHE_DIR": str(inductor)}  # fmt: skip
        out = tmp_path / f"dist{attempt}"
        proc = run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(project)],
                   env=env, cwd=project)  # fmt: skip
        assert "from cache" not in proc.stdout, "the hatch-aoti cache must be off for this test"
        (wheel,) = out.glob("*.whl")
        digests.append(hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
