"""The torch a wheel requires: stated once, in the metadata installers read before building as in the wheel."""

from __future__ import annotations

import json
import shutil
import subprocess
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
def test_the_prepared_metadata_is_the_wheels(
    frontend: str, sample_dists: tuple[Path, Path], setuptools_dists: tuple[Path, Path, str], tmp_path: Path
) -> None:
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
    torch = {"hatch": "torch==2.13.*", "setuptools": "torch<2.15,>=2.13"}[frontend]
    assert requires_dist(metadata) == requires_dist(wheel_metadata(wheel)) == [torch]


@pytest.mark.integration
def test_uv_installs_the_project_with_a_torch_the_wheel_accepts(build_env: dict[str, str], tmp_path: Path) -> None:
    """uv resolves a project directory from its static ``[project]`` table where ``dependencies`` is not
    dynamic, and from the prepared metadata otherwise: either way torch must be in what it reads."""
    import venv
    from importlib.metadata import version

    from conftest import copy_project, run
    from packaging.requirements import Requirement

    project = copy_project(REPO / "sample_project_setuptools", tmp_path / "project")
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    constraints = tmp_path / "constraints.txt"  # this machine's torch build, from its find-links: no download
    constraints.write_text(f"torch=={version('torch')}\n", encoding="utf-8")
    env = {
        **build_env,
        "UV_FIND_LINKS": ",".join(build_env["PIP_FIND_LINKS"].split()),
        "UV_CONSTRAINT": str(constraints),
        "UV_BUILD_CONSTRAINT": str(constraints),
    }
    run([sys.executable, "-m", "uv", "pip", "install", "--python", str(python), str(project)], env=env)
    code = """
import json, torch
from importlib.metadata import requires
from sample_models import compiled
print(compiled.load("mlp")(torch.randn(4, 128)).shape)
print(json.dumps([torch.__version__, requires("sample-models")]))
"""
    found, requirements = json.loads(run([str(python), "-c", code], cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert requirements == ["torch<2.15,>=2.13"] and Requirement(requirements[0]).specifier.contains(found)


def test_the_torch_requirement_is_stated_once_and_fits(tmp_path: Path) -> None:
    from hatch_aoti.pipeline.core import BuildFailed, torch_to_add
    from hatch_aoti.settings.resolve import parse_settings

    settings = parse_settings({"models": {"m": {"factory": "a:b", "inputs": []}}}, machine="x86_64", flags=set())
    window = parse_settings(
        {"torch-requirement": "torch>=2.13,<2.15", "models": {"m": {"factory": "a:b", "inputs": []}}},
        machine="x86_64",
        flags=set(),
    )
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
        torch_to_add(["torch>=2.13,<2.16"], window, "torch>=2.13,<2.15", "2.13.0", can_add=False)
    assert torch_to_add(["Torch<2.15,>=2.13"], window, "torch>=2.13,<2.15", "2.13.0", can_add=False) is None
    with pytest.raises(BuildFailed, match="allows every later torch"):
        torch_to_add(["torch"], settings, series, "2.13.0", can_add=True)
    assert torch_to_add(["torch==2.13"], settings, "torch==2.13.0", "2.13.0", can_add=False) is None
    assert torch_to_add(["torch>=3; python_version < '3'"], settings, series, "2.13.0", can_add=True) == series


def test_setuptools_adds_torch_only_to_dynamic_dependencies() -> None:
    """PEP 621: a static ``dependencies`` list is final, and installers read it without building."""
    from hatch_aoti.frontends.setuptools import _dependencies_dynamic

    assert _dependencies_dynamic({}) and _dependencies_dynamic({"tool": {}}), "no [project]: setup.py's metadata"
    assert _dependencies_dynamic({"project": {"name": "p", "dynamic": ["version", "dependencies"]}})
    assert not _dependencies_dynamic({"project": {"name": "p"}})
    assert not _dependencies_dynamic({"project": {"name": "p", "dependencies": ["numpy"], "dynamic": ["version"]}})


# -- one wheel, two torch releases ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def verified_next(setuptools_dists: tuple[Path, Path, str], torch_next_envs: Path) -> tuple[dict, str]:
    """``hatch-aoti verify WHEEL --torch <next>`` on sample_project_setuptools' wheel (built with torch 2.13,
    ``torch-requirement = "torch>=2.13,<2.15"``), in the environment the session installed beforehand."""
    from conftest import TORCH_NEXT

    wheel = setuptools_dists[1]
    command = [
        sys.executable,
        "-m",
        "hatch_aoti",
        "verify",
        str(wheel),
        "--torch",
        TORCH_NEXT,
        "--envs",
        str(torch_next_envs),
    ]
    data = subprocess.run([*command, "--json"], capture_output=True, text=True, check=False)
    text = subprocess.run(command, capture_output=True, text=True, check=False)
    assert data.returncode == text.returncode == 0, data.stdout + data.stderr
    return json.loads(data.stdout), text.stdout


@pytest.mark.integration
def test_verify_on_another_torch_says_the_window(verified_next: tuple[dict, str]) -> None:
    from conftest import TORCH_NEXT

    data, text = verified_next
    found = data["versions"][TORCH_NEXT]
    assert found["torch"].startswith(TORCH_NEXT) and data["built_with"].startswith("2.13.")
    assert {name: model["status"] for name, model in found["models"].items()} == {"mlp": "pass", "classifier": "pass"}
    assert data["passed"] is True and data["requirement"] == "torch>=2.13,<2.15"
    assert "the narrowest torch-requirement these releases support: 'torch>=2.13,<2.15'" in text
    assert f"torch {TORCH_NEXT}" in text and "pass" in text


@pytest.mark.integration
def test_the_wheel_installs_beside_the_next_torch_untouched(
    verified_next: tuple[dict, str], setuptools_dists: tuple[Path, Path, str], torch_next_envs: Path, tmp_path: Path
) -> None:
    from conftest import TORCH_NEXT, run, venv_with_torch

    python = venv_with_torch(torch_next_envs / f"torch-{TORCH_NEXT}", tmp_path / "next")
    run([str(python), "-m", "pip", "uninstall", "-y", "-q", "sample-models"])  # what verify installed there
    proc = run([str(python), "-m", "pip", "install", str(setuptools_dists[1])])
    assert "Requirement already satisfied: torch" in proc.stdout, proc.stdout
    assert (
        "Successfully installed sample-models-0.1.0" in proc.stdout
        and "torch-" not in proc.stdout.split("Successfully installed")[-1]
    ), "pip installed the wheel and nothing else"
    code = """
import json, torch
from torch.testing import assert_close
from sample_models import compiled, models
with torch.inference_mode():
    x = torch.randn(4, 128)
    assert_close(compiled.load("mlp")(x), models.build_mlp()(x))
    for batch in (1, 7, 64):
        x = torch.rand(batch, 3, 16, 16)
        assert_close(compiled.load("classifier")(x), models.build_classifier()(x))
print(json.dumps(torch.__version__))
"""
    result = run([str(python), "-c", code], cwd=tmp_path)
    assert json.loads(result.stdout.strip().splitlines()[-1]).startswith(TORCH_NEXT)


def test_the_narrowest_requirement_covers_the_passing_releases() -> None:
    from hatch_aoti.cli.window import narrowest

    assert narrowest(["2.13.0+cpu", "2.14.1"]) == "torch>=2.13,<2.15"
    assert narrowest(["2.13.0+cpu"]) == "torch==2.13.*"
    assert narrowest(["2.13.0", "2.15.0", "2.14.2"]) == "torch>=2.13,<2.16"
    assert narrowest(["2.13.0", "2.15.0"]) == "torch==2.13.*", "2.14 was not tried: not promised"
    assert narrowest(["?"]) == ""


@pytest.mark.integration
def test_a_torch_that_cannot_be_installed_fails_the_check(setuptools_dists: tuple[Path, Path, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hatch_aoti", "verify", str(setuptools_dists[1]), "--torch", "0.0.1", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    data = json.loads(proc.stdout)
    assert proc.returncode == 1 and data["passed"] is False, proc.stdout + proc.stderr
    assert data["versions"]["0.0.1"]["error"].startswith("could not install"), data


def test_only_a_wheel_can_be_tried_on_other_releases() -> None:
    import types

    from hatch_aoti.cli import window
    from hatch_aoti.cli.output import Output
    from hatch_aoti.cli.target import CliError

    installed = types.SimpleNamespace(kind="installed", where="sample_models")
    with pytest.raises(CliError, match="give a wheel file, not sample_models"):
        window.run(installed, Output(True), ["2.14.1"], None)  # type: ignore[arg-type]


def test_a_model_that_crashes_or_hangs_costs_itself_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each model's check runs in a process of its own, with a time limit (a fake interpreter here)."""
    import types

    from hatch_aoti.cli import window
    from hatch_aoti.cli.target import CliError

    fake = tmp_path / "python"
    fake.write_text(
        '#!/bin/sh\ncase "$5" in\n  crash) echo "Segmentation fault" >&2; exit 139;;\n'
        '  hang) sleep 30 & wait;;\n  *) echo \'{"torch": "2.14.1", "status": "pass", "reason": ""}\';;\nesac\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("HATCH_AOTI_VERIFY_TIMEOUT", "2")
    target = types.SimpleNamespace(package="p", loader_name="compiled", models={"crash": {}, "hang": {}, "ok": {}})
    report = window.worker(fake, target, tmp_path)  # type: ignore[arg-type]
    assert report["torch"] == "2.14.1" and report["models"]["ok"]["status"] == "pass"
    assert report["models"]["crash"] == {
        "status": "fails",
        "reason": "the check crashed (exit status 139): Segmentation fault",
    }
    assert report["models"]["hang"]["reason"].startswith("did not finish in 2 s"), "its sleeping child too"
    monkeypatch.setenv("HATCH_AOTI_VERIFY_TIMEOUT", "soon")
    with pytest.raises(CliError, match="HATCH_AOTI_VERIFY_TIMEOUT must be a whole number"):
        window.model_timeout()
