"""The setuptools front end: the same declaration under [tool.hatch-aoti], the same wheel."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
from conftest import Runtime, run, write_project

pytestmark = pytest.mark.integration


def package_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n) for n in zf.namelist() if n.startswith("sample_models/")}


def test_sdist_carries_sources_not_artifacts(setuptools_dists: tuple[Path, Path, str]) -> None:
    with tarfile.open(setuptools_dists[0]) as tf:
        names = tf.getnames()
    assert any(n.endswith("src/sample_models/models.py") for n in names)
    assert any(n.endswith("src/sample_models/weights.pt") for n in names)
    assert not any("_aoti" in n or "compiled" in n.split("/") or n.endswith(".so") for n in names)


def test_the_wheel_is_the_hatch_wheel_under_the_package(
    setuptools_dists: tuple[Path, Path, str], sample_dists: tuple[Path, Path]
) -> None:
    """Same tag, same loader, manifest and artifacts, byte for byte; the torch pin and the
    platlib root described the same way."""
    _, wheel, output = setuptools_dists
    hatch_wheel = sample_dists[1]
    assert wheel.name == hatch_wheel.name, "same name, version and tag"
    ours, theirs = package_files(wheel), package_files(hatch_wheel)
    assert sorted(ours) == sorted(theirs)
    assert [n for n in ours if ours[n] != theirs[n]] == []
    assert any(n.endswith(".so") for n in ours) and "sample_models/compiled/__init__.py" in ours
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read("sample_models-0.1.0.dist-info/METADATA").decode()
        wheel_meta = zf.read("sample_models-0.1.0.dist-info/WHEEL").decode()
    assert "Requires-Dist: torch<2.15,>=2.13" in meta, "its torch-requirement: a window of two releases"
    assert "Root-Is-Purelib: false" in wheel_meta and f"Tag: {wheel.name.split('-', 2)[2][:-4]}" in wheel_meta
    assert "aoti: [1/2] mlp:" in output and "aoti: [2/2] classifier:" in output, "progress lines as with hatchling"
    run([sys.executable, "-m", "twine", "check", "--strict", str(wheel)])


def test_the_wheel_matches_eager_in_a_torch_only_venv(
    setuptools_dists: tuple[Path, Path, str], runtime: Runtime, tmp_path: Path
) -> None:
    with zipfile.ZipFile(setuptools_dists[1]) as zf:
        zf.extractall(tmp_path / "unpacked")
    result = runtime.json(
        f"""
        import json, sys; sys.path.insert(0, {str(tmp_path / "unpacked")!r})
        import torch
        from sample_models import compiled, models
        with torch.inference_mode():
            x, images = torch.randn(4, 128), torch.rand(7, 3, 16, 16)
            mlp = (compiled.load("mlp")(x) - models.build_mlp()(x)).abs().max().item()
            got, want = compiled.load("classifier")(images), models.build_classifier()(images)
        print(json.dumps({{"mlp": mlp, "classifier": max((a - b).abs().max().item() for a, b in zip(got, want)),
                           "file": compiled.__file__}}))
        """
    )
    assert result["mlp"] < 1e-5 and result["classifier"] < 1e-5
    assert result["file"].startswith(str(tmp_path / "unpacked"))


def test_pip_wheel_gives_the_same_package(
    setuptools_project: Path, build_env: dict[str, str], sample_dists: tuple[Path, Path], tmp_path: Path
) -> None:
    """`pip wheel` without build isolation (the test venv's setuptools, hatch-aoti and torch)."""
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(setuptools_project),
        ],
        env=build_env,
        cwd=setuptools_project,
    )
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name == sample_dists[1].name
    assert package_files(wheel) == package_files(sample_dists[1])


def test_editable_install_loads_compiled_models_and_leaves_the_sources(
    setuptools_project: Path, dev_venv: Path, build_env: dict[str, str]
) -> None:
    """Without build isolation, as projects are developed: the venv's own setuptools, torch and
    hatch-aoti (from the wheelhouse)."""
    sources = setuptools_project / "src"
    before = sorted(p.relative_to(sources) for p in sources.rglob("*") if "__pycache__" not in p.parts)
    python = dev_venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", "hatch-aoti"], env=build_env)
    run(
        [str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "-e", str(setuptools_project)],
        env=build_env,
    )
    probe = run(
        [
            str(python),
            "-c",
            "import torch, sample_models; from sample_models import compiled, models;"
            "x = torch.randn(4, 128); print(sample_models.__file__);"
            "print((compiled.load('mlp')(x) - models.build_mlp()(x)).abs().max().item())",
        ],
        cwd=dev_venv,
    )
    package_file, err = probe.stdout.split()
    assert Path(package_file).resolve() == (sources / "sample_models" / "__init__.py").resolve()
    assert float(err) < 1e-5
    after = sorted(p.relative_to(sources) for p in sources.rglob("*") if "__pycache__" not in p.parts)
    added = [p for p in after if p not in before]
    assert not [p for p in added if "_aoti" in p.parts or "compiled" in p.parts or p.name.endswith(".so")], added


PLAIN = """
    [build-system]
    requires = ["setuptools>=77"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "plain"
    version = "1.0"
    dependencies = ["packaging"]
"""


def test_a_project_without_the_table_builds_byte_identical_wheels(tmp_path: Path) -> None:
    """hatch-aoti's setuptools hook runs for every setuptools build; without its table it changes nothing."""
    import importlib.metadata

    import setuptools

    hooks = importlib.metadata.entry_points(group="setuptools.finalize_distribution_options")
    assert any(ep.value.startswith("hatch_aoti.") for ep in hooks), "the hook must be live in this environment"
    project = tmp_path / "plain"
    (project / "plain").mkdir(parents=True)
    (project / "plain" / "__init__.py").write_text("VALUE = 1\n")
    (project / "pyproject.toml").write_text(PLAIN.replace("\n    ", "\n"))
    bare = tmp_path / "bare-venv"
    venv.EnvBuilder(with_pip=True).create(bare)
    run([str(bare / "bin" / "python"), "-m", "pip", "install", "-q", f"setuptools=={setuptools.__version__}"])
    wheels = {}
    for label, python in (("with hatch-aoti", sys.executable), ("without", str(bare / "bin" / "python"))):
        out = tmp_path / label
        run(
            [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(project)],
            cwd=project,
        )
        (wheel,) = out.glob("*.whl")
        wheels[label] = wheel.read_bytes()
    probe = subprocess.run([str(bare / "bin" / "python"), "-c", "import hatch_aoti"], capture_output=True, cwd=tmp_path)
    assert probe.returncode != 0, "the second build must not see hatch-aoti"
    assert wheels["with hatch-aoti"] == wheels["without"]


def test_a_table_that_is_not_a_table_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    project = write_project(tmp_path / "p", "oddpkg", "[tool]\nhatch-aoti = 3\n", {}, frontend="setuptools")
    proc = run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(tmp_path / "dist"), str(project)],
        check=False,
        cwd=project,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in text, text
    assert "tool.hatch-aoti: must be a table" in text
    assert not list(tmp_path.glob("dist/*.whl"))
