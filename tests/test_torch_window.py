"""The torch a wheel requires: stated once, in the metadata installers read before building as in the wheel."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO


def requires_dist(metadata: str) -> list[str]:
    return sorted(line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:"))


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return zf.read(name).decode("utf-8")


@pytest.mark.integration
@pytest.mark.parametrize("frontend", ["hatch", "setuptools"])
def test_the_prepared_metadata_is_the_wheels(frontend: str, sample_dists: tuple[Path, Path],
                                             setuptools_dists: tuple[Path, Path, str], tmp_path: Path) -> None:  # fmt: skip
    from pyproject_hooks import BuildBackendHookCaller

    project = REPO / ("sample_project" if frontend == "hatch" else "sample_project_setuptools")
    backend = {"hatch": "hatchling.build", "setuptools": "setuptools.build_meta"}[frontend]
    copy = tmp_path / project.name
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("dist", "build", "*.egg-info"))
    caller = BuildBackendHookCaller(str(copy), backend, python_executable=sys.executable)
    (tmp_path / "prepared").mkdir()
    prepared = caller.prepare_metadata_for_build_wheel(str(tmp_path / "prepared"))
    metadata = (tmp_path / "prepared" / prepared / "METADATA").read_text(encoding="utf-8")
    wheel = (sample_dists if frontend == "hatch" else setuptools_dists)[1]
    assert requires_dist(metadata) == requires_dist(wheel_metadata(wheel)) and "torch==2.13.*" in requires_dist(metadata)


def test_the_torch_requirement_is_stated_once_and_fits(tmp_path: Path) -> None:
    from hatch_aoti.config import parse_settings
    from hatch_aoti.pipeline import BuildFailed, torch_to_add

    settings = parse_settings({"models": {"m": {"factory": "a:b", "inputs": []}}}, machine="x86_64", flags=set())
    window = parse_settings({"torch-requirement": "torch>=2.13,<2.15", "models": {"m": {"factory": "a:b",
                            "inputs": []}}}, machine="x86_64", flags=set())  # fmt: skip
    series = "torch==2.13.*"
    assert torch_to_add(["numpy"], settings, series, "2.13.0", can_add=True) == series
    assert torch_to_add(["torch>=2.13,<2.15"], settings, series, "2.13.0", can_add=True) is None, "no second pin"
    with pytest.raises(BuildFailed, match=r'add "torch==2.13.\*" to \[project\] dependencies'):
        torch_to_add(["numpy"], settings, series, "2.13.0", can_add=False)
    with pytest.raises(BuildFailed, match="does not allow the torch in the build environment"):
        torch_to_add(["torch>=2.14"], settings, series, "2.13.0", can_add=True)
    with pytest.raises(BuildFailed, match='precompiled models load only under torch==2.13.0: state "torch==2.13.0"'):
        torch_to_add(["torch>=2.13,<2.15"], settings, "torch==2.13.0", "2.13.0", can_add=True)
    assert torch_to_add(["torch==2.13.0"], settings, "torch==2.13.0", "2.13.0", can_add=False) is None
    assert torch_to_add(["torch>=2.13,<2.15"], window, "torch>=2.13,<2.15", "2.13.0", can_add=False) is None
    with pytest.raises(BuildFailed, match="both state the torch requirement"):
        torch_to_add(["torch>=2.13"], window, "torch>=2.13,<2.15", "2.13.0", can_add=False)
