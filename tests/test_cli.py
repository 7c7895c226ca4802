"""The ``hatch-aoti`` command line on real wheels: sample_project's (as a wheel and installed) and the
mixed-backend one.

Most commands run in this process (``main([...])``), which has torch imported already;
a few run as the console script, as a user runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, run

from hatch_aoti.cli import calls, main
from hatch_aoti.store import cache


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    """Run a command with ``--json`` in this process: (exit status, its document)."""
    status, out, _ = text_cli(capsys, *args, "--json")
    return status, json.loads(out)


def text_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run a command in this process: (exit status, stdout, stderr).

    Its imports (loaders, a wheel's package) are undone afterwards, as its own process
    ending would; the package modules it imported are kept in ``IMPORTED``.
    """
    path, modules = list(sys.path), set(sys.modules)
    try:
        status = main(list(args))
    finally:
        sys.path[:] = path
        IMPORTED[:] = sorted(n for n in set(sys.modules) - modules if n.startswith(("sample_models", "mixpkg")))
        for name in IMPORTED:
            del sys.modules[name]
    out, err = capsys.readouterr()
    return status, out, err


IMPORTED: list[str] = []


def script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The console script, as a user runs it (output piped)."""
    command = [str(Path(sys.executable).with_name("hatch-aoti")), *args]
    return subprocess.run(command, capture_output=True, text=True, check=False, env=env)


# -- no compiling: the command's own logic -------------------------------------------------

ENTRY = {
    "call": [
        {"dtype": "int64", "device": "cpu", "shape": [{"name": "batch", "min": 1, "max": 8}, 7], "high": 5},
        {
            "dtype": "float32",
            "device": "cpu",
            "shape": [{"name": "batch", "min": 1, "max": 8}, {"name": "seq", "min": 2, "max": None}],
        },
    ],
    "verification": {
        "tried": [
            {"inputs": "example", "shapes": [[3, 7], [3, 5]], "seed": 0},
            {"inputs": "sample 1", "shapes": [[8, 7], [8, 2]]},
        ]
    },
}


def test_cases_are_the_builds() -> None:
    """The build's cases at its sizes, its own inputs where it generated them; without a report, the
    example and each dim's ends."""
    assert calls.example_sizes(ENTRY) == {"batch": 3, "seq": 5}
    found = [(c.label, c.sizes, c.seed) for c in calls.cases(ENTRY)]
    assert found == [("example", {"batch": 3, "seq": 5}, 0), ("sample 1", {"batch": 8, "seq": 2}, None)]
    bare = {"call": ENTRY["call"]}
    labels = [(c.label, c.sizes) for c in calls.cases(bare)]
    assert labels == [
        ("example", {"batch": 4, "seq": 2}),
        ("batch=1 (min)", {"batch": 1, "seq": 2}),
        ("batch=8 (max)", {"batch": 8, "seq": 2}),
    ]
    assert calls.describe(ENTRY) == "int64[batch, 7], float32[batch, seq]"
    assert calls.parse_shape(["batch=8", "seq=100"], ENTRY) == {"batch": 8, "seq": 100}
    for bad, message in (["batch=9"], "batch must be an integer in [1, 8]"), (["len=3"], "no dynamic dim 'len'"):
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            calls.parse_shape(bad, ENTRY)
    from torch.utils import _pytree as pytree

    spec = pytree.treespec_dumps(pytree.tree_flatten(((0, 0), {}))[1])
    ids, _ = calls.make_inputs(ENTRY, {"batch": 8, "seq": 2}, spec, seed=0)
    assert ids[0].shape == (8, 7) and 0 <= int(ids[0].min()) and int(ids[0].max()) < 5, "the recorded value range"


def test_the_cli_asks_the_loader_what_stops_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """One owner: the loader says whether a model can run here, asked of hatch-aoti's own copy of it
    with the target's manifest (none of the target's code runs); the CLI adds only the wheel's torch
    requirement against this environment."""
    import types

    from hatch_aoti.cli import machine
    from hatch_aoti.loader import host

    def target(requires: list[str]) -> object:
        return types.SimpleNamespace(model=lambda name: {"name": name}, dist=types.SimpleNamespace(requires=requires))

    monkeypatch.setattr(host, "problems", lambda entry, *_, **__: [f"{entry['name']}: the loader says no"])
    assert machine.problems(target([]), "m") == ["m: the loader says no"]  # type: ignore[arg-type]
    found = machine.problems(target(["torch==0.1"]), "m")  # type: ignore[arg-type]
    assert found[0].startswith("the wheel requires torch==0.1; this environment has torch") and len(found) == 2

    def broken(entry: object, *_: object, **__: object) -> list[str]:
        raise KeyError("cpu")

    monkeypatch.setattr(host, "problems", broken)
    assert machine.problems(target([]), "m") == [  # type: ignore[arg-type]
        "the loader cannot be asked: KeyError: 'cpu'"
    ], "a message, not a traceback"


def test_a_wheel_with_a_one_file_loader_is_named_as_such(tmp_path: Path) -> None:
    """A wheel an earlier hatch-aoti built: its models cannot be loaded by this one, and the message says why."""
    from hatch_aoti.cli.target import CliError, Dist, Target

    (tmp_path / "compiled.py").write_text("raise SystemExit('never run')\n")
    target = Target("wheel", "old.whl", "pkg", "compiled", tmp_path, {}, Dist())  # type: ignore[arg-type]
    with pytest.raises(CliError, match=r"old.whl: its loader is one file \(compiled.py\), as an earlier hatch-aoti"):
        target.loader()


def _wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def test_bad_targets_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _wheel(tmp_path / "plain-1.0-py3-none-any.whl", {"plain/__init__.py": "", "plain-1.0.dist-info/WHEEL": ""})
    (tmp_path / "garbage.whl").write_bytes(b"not a zip")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    manifests = {
        "[]": "has no `models` table",
        "{not json": "unreadable _aoti/manifest.json",
        '{"format": 1, "models": {}}': "is of format 1; this hatch-aoti reads format 2",
        '{"format": 2, "models": {"m": 3}}': "model 'm': not a table",
        '{"format": 2, "models": {"m": {}}}': "model 'm': `call` is missing or not a list",
        '{"format": 2, "models": {"m": {"call": [], "cpu": {}, "device": "cpu", "file": "x.so"}}}': (
            "model 'm': `cpu.arch` is missing or not a str"
        ),
        '{"format": 2, "models": {}, "package": "bad"}': "`loader` is missing or not a str",
    }
    cases = {
        str(tmp_path / "missing.whl"): "no such wheel",
        str(plain): "was not built by hatch-aoti: it has no _aoti/manifest.json",
        str(tmp_path / "garbage.whl"): "cannot read",
        str(tmp_path / "proj"): "no wheel of x in",
        "no_such_package_here": "no such wheel, directory or installed package",
        "json": "json has no models compiled by hatch-aoti",
        "toppkg": "models are compiled into toppkg.sub: name that instead",
    }
    (tmp_path / "site" / "toppkg" / "sub" / "_aoti").mkdir(parents=True)
    (tmp_path / "site" / "toppkg" / "__init__.py").write_text("")
    (tmp_path / "site" / "toppkg" / "sub" / "_aoti" / "manifest.json").write_text("{}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for n, (text, message) in enumerate(manifests.items()):
        cases[str(_wheel(tmp_path / f"bad{n}-1.0-py3-none-any.whl", {"bad/_aoti/manifest.json": text}))] = message
    for target, message in cases.items():
        assert main(["inspect", target]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hatch-aoti: error: ") and message in err and len(err.strip().splitlines()) == 1, err
    status, document = cli(capsys, "verify", str(plain))
    assert status == 2 and "not built by hatch-aoti" in document["error"]


def test_cache_info_names_a_tuning_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV_DIR, str(root))
    (tmp_path / "empty").mkdir()
    cache.CompileCache(root).store("ab" * 32, tmp_path / "empty", {"entry": {"tuning": {"dropped": "compile: boom"}}})
    (entry,) = cli(capsys, "cache", "info")[1]["entries"]
    assert (entry["backend"], entry["device"], entry["size"]) == ("tuning note", "-", 0)


def test_cache_info_prune_and_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV_DIR, str(root))
    store = cache.CompileCache(root)
    for n, size in enumerate((1000, 3000, 5000)):
        artifact = tmp_path / f"a{n}"
        artifact.mkdir()
        (artifact / "lib.so").write_bytes(b"x" * size)
        store.store(f"{n:02d}" * 32, artifact, {"entry": {"backend": "aoti", "device": "cpu"}})
        os.utime(store._entry_dir(f"{n:02d}" * 32) / "entry.json", (1000 + n, 1000 + n))
    for fd in store._held.values():  # as when the build that stored them has ended
        os.close(fd)
    (root / "bytecode").mkdir()
    (root / "bytecode" / "ab").write_bytes(b"y" * 10)
    status, info = cli(capsys, "cache", "info")
    assert status == 0 and [e["size"] for e in info["entries"]] == [5000, 3000, 1000]  # most recently used first
    assert info["size"] == 9000 and info["bytecode"]["files"] == 1 and info["untrusted"] is None
    monkeypatch.setenv(cache.ENV_MAX_SIZE, "lots")  # --max-size replaces it
    status, pruned = cli(capsys, "cache", "prune", "--max-size", "8500")  # oldest first, down to the size
    assert pruned["removed"] == ["00" * 32] and pruned["size"] == 8000
    monkeypatch.delenv(cache.ENV_MAX_SIZE)
    assert main(["cache", "prune", "--max-size", "lots"]) == 2
    assert "--max-size must be a size" in capsys.readouterr().err
    status, cleared = cli(capsys, "cache", "clear")
    assert sorted(cleared["removed"]) == ["01" * 32, "02" * 32] and cleared["bytecode_removed"]["size"] == 10
    assert cli(capsys, "cache", "info")[1]["entries"] == [] and not (root / "bytecode").exists()


# -- on sample_project's wheel ---------------------------------------------------------------


@pytest.fixture(scope="session")
def installed(sample_dists: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sample_project's wheel, installed by pip into a directory of its own."""
    site = tmp_path_factory.mktemp("cli-site")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(sample_dists[1]),
        ]
    )
    return site


@pytest.fixture
def on_path(installed: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(installed))
    return installed


@pytest.mark.integration
def test_inspect_a_wheel(sample_dists: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, data = cli(capsys, "inspect", str(sample_dists[1]))
    assert status == 0 and data["kind"] == "wheel" and data["loader"] == "sample_models.compiled"
    assert data["distribution"]["tags"] == [sample_dists[1].name.split("-", 2)[2].removesuffix(".whl")]
    series = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert f"torch=={series}.*" in data["distribution"]["requires"] and data["this_machine"]["torch_problem"] is None
    mlp, classifier = data["models"]["mlp"], data["models"]["classifier"]
    assert mlp["inputs"] == "float32[4, 128]" and mlp["factory"] == "sample_models.models:build_mlp"
    assert mlp["packed_at_load"] == 0, "too small to be prepacked"
    assert classifier["dynamic"] == {"batch": {"min": 1, "max": 64}} and classifier["cpu"]["target"] == "x86-64-v3"
    assert "avx2" in classifier["cpu"]["features"] and classifier["runs_here"] and classifier["problems"] == []
    assert classifier["verification"]["passed"] and len(classifier["verification"]["tried"]) == 4
    (library,) = mlp["files"]
    assert library["path"].endswith(".so") and len(library["recorded_sha256"]) == 64 and library["size"] > 100_000
    loader = {f"compiled/{p.name}" for p in (REPO / "hatch_aoti" / "loader").glob("*.py")}
    assert {f["path"] for f in data["files"]} == {*loader, "_aoti/manifest.json"}


@pytest.mark.integration
def test_inspect_as_a_user_sees_it(sample_dists: tuple[Path, Path]) -> None:
    """The console script, piped: plain text (no colour codes), the models as a table."""
    proc = script("inspect", str(sample_dists[1]))
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" not in proc.stdout
    table_row = next(line for line in proc.stdout.splitlines() if line.startswith("classifier "))
    assert table_row.split()[:4] == ["classifier", "aoti", "cpu", "float32[batch,"]
    module = subprocess.run(
        [sys.executable, "-m", "hatch_aoti", "inspect", "--json", str(sample_dists[1])],
        capture_output=True,
        text=True,
        check=True,
    )
    assert list(json.loads(module.stdout)["models"]) == ["mlp", "classifier"]


@pytest.mark.integration
def test_human_output_and_project_directories(
    sample_dists: tuple[Path, Path],
    mixed_wheel: tuple[Path, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A project directory means its own newest wheel; a folder that merely shares a package's name does not."""
    project = tmp_path / "proj"
    (project / "dist").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[project]\nname = "sample-models"\n')
    shutil.copy(sample_dists[1], project / "dist")
    shutil.copy(mixed_wheel[0], project / "dist")  # newer, but another project's
    status, text, _ = text_cli(
        capsys, "bench", str(project), "mlp", "--repeats", "2", "--min-time", "0.001", "--cold", "1"
    )
    assert status == 0 and "mlp: per call, median (range over rounds)" in text and "float32[4, 128]" in text
    assert "mlp: cold start, fresh process to first output" in text
    status, text, _ = text_cli(capsys, "profile", str(project), "mlp", "-o", str(tmp_path / "t.json"), "--calls", "2")
    assert status == 0 and "Top by self CPU time" in text and "mlp (compiled)" in text
    assert "without kernel profiling" in text
    status, _, err = text_cli(capsys, "profile", str(project), "mlp", "-o", str(tmp_path))
    assert status == 2 and "is a directory" in err
    status, text, _ = text_cli(capsys, "cache", "info")
    assert status == 0 and "compile cache: " in text
    (tmp_path / "sample_models").mkdir()
    monkeypatch.chdir(tmp_path)
    status, _, err = text_cli(capsys, "inspect", "sample_models")  # not a project: a package, not installed here
    assert status == 2 and "no such wheel, directory or installed package: sample_models" in err


@pytest.mark.integration
def test_every_command_on_the_installed_package(
    on_path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """By package and by loader name; without --eager nothing of the package is imported."""
    for name in ("sample_models", "sample_models.compiled"):
        status, data = cli(capsys, "inspect", name)
        assert status == 0 and data["kind"] == "installed" and data["distribution"]["name"] == "sample-models"
    status, data = cli(capsys, "verify", "sample_models")
    loader = len(list((REPO / "hatch_aoti" / "loader").glob("*.py")))
    # 2 libraries, and RECORD's files: 4 of the package and the loader's modules
    assert status == 0 and data["passed"] and data["files"]["checked"] == 2 + 4 + loader, data
    assert IMPORTED and all(n.startswith("sample_models.compiled") for n in IMPORTED), (
        "the loader, by path; not the package"
    )
    cases = data["models"]["classifier"]["cases"]
    assert [c["case"] for c in cases] == ["example", "min", "mid", "max"], "the build's cases"
    assert all(c["the_builds_inputs"] for c in cases), "remade from the manifest: its declared inputs"
    status, data = cli(capsys, "verify", "sample_models", "--eager")
    assert (
        status == 0 and "sample_models.models" in IMPORTED and data["models"]["mlp"]["cases"][0]["max_abs_err"] < 1e-4
    )
    status, data = cli(capsys, "bench", "sample_models", "mlp", "--repeats", "2", "--min-time", "0.001", "--cold", "0")
    assert status == 0 and data["models"]["mlp"]["per_call"][0]["compiled"]["median_s"] > 0
    status, data = cli(capsys, "profile", "sample_models", "classifier", "-o", str(tmp_path / "t.json"), "--calls", "2")
    spans, inside = _spans(tmp_path / "t.json", "classifier (compiled)")
    assert status == 0 and len(spans) == 2 and any(e["name"].startswith("aten::") for e in inside)


@pytest.mark.integration
def test_what_cannot_run_here_is_named_before_loading(
    installed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA model on a machine without CUDA, a CPU feature this machine lacks (as if built elsewhere)."""
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    manifest = site / "sample_models" / "_aoti" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["models"]["classifier"]["device"] = "cuda:0"
    data["models"]["mlp"]["cpu"]["features"].append("no_such_feature")
    manifest.write_text(json.dumps(data))
    monkeypatch.syspath_prepend(str(site))
    status, data = cli(capsys, "inspect", "sample_models")
    (cpu,) = data["models"]["mlp"]["problems"]
    assert cpu.startswith("needs a CPU with x86-64-v3 instructions; this CPU lacks no_such_feature."), cpu
    (device,) = data["models"]["classifier"]["problems"]
    assert device.startswith("was built for cuda:0, but this torch (") and device.endswith("sees no CUDA device")
    status, data = cli(capsys, "verify", "sample_models")
    assert status == 1 and data["files"]["problems"][0].startswith("_aoti/manifest.json differs from RECORD")
    assert data["models"]["mlp"]["reason"].startswith("not loaded: _aoti/manifest.json differs")


@pytest.mark.integration
def test_verify_catches_a_flipped_byte_and_a_truncated_library(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    (mlp,) = (site / "sample_models" / "_aoti" / "mlp").rglob("*.so")
    data = bytearray(mlp.read_bytes())
    data[len(data) // 2] ^= 0x01
    mlp.write_bytes(bytes(data))
    (classifier,) = (site / "sample_models" / "_aoti" / "classifier").rglob("*.so")
    with classifier.open("r+b") as f:
        f.truncate(4096)
    proc = script("verify", "sample_models", env={**os.environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(
        "FAILED  mlp: _aoti/mlp/data/aotinductor/model/model.wrapper.so differs from the manifest (sha256 "
    )
    assert lines[0].endswith("damaged or modified") and lines[0].count("differs") == 1
    assert lines[1].startswith("FAILED  classifier: _aoti/classifier/data/") and "damaged or modified" in lines[1]
    assert lines[-1].startswith("FAILED:") and "Traceback" not in proc.stderr


@pytest.mark.integration
def test_verify_eager_and_bench_against_eager(
    sample_dists: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, data = cli(capsys, "verify", str(sample_dists[1]), "--eager")
    assert status == 0 and data["passed"] and "sample_models.models" in IMPORTED
    for case in data["models"]["classifier"]["cases"]:
        assert case["max_abs_err"] < 1e-4, case
    status, data = cli(
        capsys,
        "bench",
        str(sample_dists[1]),
        "classifier",
        "--eager",
        "--repeats",
        "2",
        "--min-time",
        "0.001",
        "--cold",
        "1",
    )
    result = data["models"]["classifier"]
    assert status == 0 and result["eager"] == "measured" and len(result["per_call"]) == 4  # the build's cases
    assert all(row["eager"]["median_s"] > 0 and row["compiled"]["median_s"] > 0 for row in result["per_call"])
    cold = result["cold_start"]
    assert (
        cold["ratio"] > 0 and cold["import_torch"]["min_s"] <= cold["import_torch"]["median_s"] and cold["rounds"] == 1
    )
    assert main(["bench", str(sample_dists[1]), "nope"]) == 2


def _spans(trace: Path, name: str) -> tuple[list[dict], list[dict]]:
    """The spans named ``name``, and the other events inside them."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    spans = [e for e in events if e["name"] == name]
    inside = [
        e
        for e in events
        if e["name"] != name and any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] for s in spans)
    ]
    return spans, inside


@pytest.mark.integration
def test_profile_writes_a_trace_of_the_compiled_model(
    sample_dists: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    status, data = cli(
        capsys, "profile", str(sample_dists[1]), "classifier", "-o", str(trace), "--calls", "4", "--shape", "batch=8"
    )
    assert status == 0 and data["inputs"] == "float32[8, 3, 16, 16]" and not data["kernel_profile"]
    spans, inside = _spans(trace, "classifier (compiled)")
    assert len(spans) == 4
    assert any(e["name"].startswith("aten::") for e in inside), "the ATen ops the compiled code calls"
    assert main(["profile", str(sample_dists[1]), "classifier", "--shape", "batch=65"]) == 2


@pytest.mark.integration
def test_profile_shows_the_kernels_of_a_profiling_build(
    mixed_wheel: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The mixed wheel's ``fast`` model is built with ``cpp.enable_kernel_profile``."""
    trace = tmp_path / "trace.json"
    status, data = cli(capsys, "profile", str(mixed_wheel[0]), "fast", "-o", str(trace), "--calls", "3", "--eager")
    assert status == 0 and data["kernel_profile"]
    names = {e["name"] for e in data["top"]}
    assert {"fast (compiled)", "fast (eager)"} <= names
    _, inside = _spans(trace, "fast (compiled)")
    kernels = {e["name"] for e in inside}
    assert any(n.startswith("graph_0_cpp_fused") for n in kernels), kernels
    assert any(n.startswith("aoti_torch_cpu_") for n in kernels), kernels


@pytest.mark.integration
def test_verify_every_backend(
    mixed_wheel: tuple[Path, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Precompiled models run the package's code when loaded: skipped unless --eager allows it."""
    status, data = cli(capsys, "verify", str(mixed_wheel[0]))
    assert status == 0 and {n: r["status"] for n, r in data["models"].items()} == {
        "fast": "ok",
        "guarded": "skipped",
        "batched": "skipped",
        "plain": "ok",
    }
    assert "pass --import-package (or --eager)" in data["models"]["guarded"]["reason"]
    status, data = cli(capsys, "verify", str(mixed_wheel[0]), "--import-package")
    assert status == 0 and {r["status"] for r in data["models"].values()} == {"ok"}, data
    assert "mixpkg.models" in IMPORTED and "max_abs_err" not in data["models"]["guarded"]["cases"][0]
    status, data = cli(capsys, "verify", str(mixed_wheel[0]), "--eager")
    assert status == 0 and {r["status"] for r in data["models"].values()} == {"ok"}, data
    assert [c["case"] for c in data["models"]["batched"]["cases"]][:3] == ["example", "mid", "max"]  # example: the min
    status, data = cli(capsys, "bench", str(mixed_wheel[0]), "guarded", "--repeats", "1", "--cold", "0")
    assert status == 1 and "pass --import-package" in data["models"]["guarded"]["skipped"], "nothing timed: exit 1"
