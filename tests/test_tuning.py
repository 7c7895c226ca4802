"""`tune = true`: the candidates, how the coordinator keeps the fastest, and a real tuned build."""

from __future__ import annotations

import json
import os
import re
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TABLES, Runtime, build_no_isolation, write_project

from hatch_aoti.pipeline import protocol
from hatch_aoti.settings.reader import ConfigError
from hatch_aoti.settings.resolve import parse_settings
from hatch_aoti.store.cache import CompileCache
from hatch_aoti.store.tiers import Tiers
from hatch_aoti.worker import tuning
from hatch_aoti.worker.coordinator import Coordinator
from hatch_aoti.worker.split import Miss


def test_candidates_keep_the_users_settings_and_drop_duplicates() -> None:
    settings = {"freezing": True, "cpp.weight_prepack": False}
    found = tuning.candidates(settings, {})
    assert list(found) == ["defaults", "cpp-gemm", "concat-linear", "no-freezing"]
    assert found["defaults"] == settings and found["no-freezing"]["freezing"] is False
    # the user's settings win: with freezing fixed off, `no-freezing` is `defaults` again
    fixed = tuning.candidates({**settings, "freezing": False}, {"freezing": False})
    assert "no-freezing" not in fixed and all(c["freezing"] is False for c in fixed.values())


def test_tune_is_read_per_model_and_for_the_table() -> None:
    models = {
        "a": {"factory": "m:a", "inputs": [{"shape": [1]}]},
        "b": {"factory": "m:b", "inputs": [{"shape": [1]}], "tune": False},
        "c": {"factory": "m:c", "inputs": [{"shape": [1]}], "backend": "precompile"},
    }
    specs = {s.name: s for s in parse_settings({"tune": True, "models": models}, machine="x86_64", flags=set()).models}
    assert (specs["a"].tune, specs["b"].tune, specs["c"].tune) == (True, False, False)
    assert not parse_settings({"models": models}, machine="x86_64", flags=set()).models[0].tune
    with pytest.raises(ConfigError) as err:
        parse_settings({"models": {"c": {**models["c"], "tune": True}}}, machine="x86_64", flags=set())
    assert f"{TABLES['hatch']}.models.c.tune" in str(err.value) and "'precompile'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_settings({"tune": "yes", "models": models}, machine="x86_64", flags=set())
    assert f"{TABLES['hatch']}.tune" in str(err.value)


def coordinator(tmp_path: Path, names: list[str]) -> tuple[Coordinator, list[protocol.Event]]:
    """A coordinator with only what keeping candidates needs: staged directories, a local cache and
    its events."""
    events: list[protocol.Event] = []
    self = object.__new__(Coordinator)
    self.emit, self.artifacts, self.stage = events.append, tmp_path, tmp_path.parent / "stage"
    self.cache = Tiers(CompileCache(tmp_path.parent / "cache"), None, print, tmp_path.parent)
    self.entries, self.failed = {}, {}
    self.tuner = tuning.Tuner(self)
    self.tuner.begin("m", names, 0.0)
    for name in names:
        (tmp_path / f"m--{name}").mkdir()
        (tmp_path / f"m--{name}" / "lib.so").write_text(name)
    return self, events


def candidate_miss(label: str, key: str = "", entry: dict | None = None) -> Miss:
    model = SimpleNamespace(spec=SimpleNamespace(name="m"))
    return Miss(model, None, key, entry or {}, None, label)  # type: ignore[arg-type]


def test_the_fastest_verified_candidate_is_kept_and_a_failing_one_dropped(tmp_path: Path) -> None:
    self, events = coordinator(tmp_path, ["defaults", "cpp-gemm", "no-freezing"])
    entry = {"verification": {"passed": True, "tried": []}}
    self.tuner.tuned("m--defaults", entry, None, 0.003, cached="")
    self.fail_or_drop(candidate_miss("m--cpp-gemm"), "compile", "the aoti backend failed: boom\nmore")
    assert "m" not in self.entries, "not before every candidate is in"
    self.tuner.tuned("m--no-freezing", entry, None, 0.002, cached="local")
    assert self.entries["m"]["tuning"] == {
        "chosen": "no-freezing",
        "candidates": [
            {"candidate": "defaults", "ms": 3.0},
            {"candidate": "cpp-gemm", "dropped": "compile: the aoti backend failed: boom"},
            {"candidate": "no-freezing", "ms": 2.0},
        ],
        "timed_on": "the build machine, the example inputs",
    }
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and (tmp_path / "m" / "lib.so").read_text() == "no-freezing"
    lines = [e.message for e in events if isinstance(e, protocol.Info)]
    assert "m: candidate cpp-gemm dropped at compile: the aoti backend failed: boom" in lines
    assert "m: tuned: kept no-freezing (times taken on this machine)" in lines
    assert isinstance(events[-1], protocol.Built) and not self.failed


def test_a_model_whose_candidates_all_fail_fails(tmp_path: Path) -> None:
    self, events = coordinator(tmp_path, ["defaults", "cpp-gemm"])
    for label in ("m--defaults", "m--cpp-gemm"):
        self.fail_or_drop(candidate_miss(label), "verify", "output[0]: mismatch")
    assert self.failed == {"m": "tune"} and not list(tmp_path.iterdir())
    (failed,) = [e for e in events if isinstance(e, protocol.Failed)]
    assert failed.message == (
        "no candidate compiled and verified "
        "(defaults: verify: output[0]: mismatch; cpp-gemm: verify: output[0]: mismatch)"
    )


def test_a_candidate_that_fails_for_good_is_remembered_and_not_compiled_again(tmp_path: Path) -> None:
    stage = tmp_path / "staged"
    stage.mkdir()
    self, events = coordinator(stage, ["defaults", "cpp-gemm", "concat-linear"])
    entry = {"verification": {"passed": True, "tried": []}}
    self.tuner.tuned("m--defaults", entry, None, 0.003, cached="")
    self.fail_or_drop(candidate_miss("m--cpp-gemm", "a" * 64), "compile", "the aoti backend failed: boom", lasting=True)
    self.fail_or_drop(candidate_miss("m--concat-linear", "b" * 64), "compile", "the compile helper died")
    local = self.cache.local
    assert local is not None
    found = local.lookup("a" * 64, tmp_path / "found")
    assert found is not None
    assert found["entry"] == {
        "tuning": {"dropped": "compile: the aoti backend failed: boom", "machine": tuning.machine()}
    }
    assert local.lookup("b" * 64, tmp_path / "found") is None, "a failure of the process is not remembered"
    first = self.entries["m"]["tuning"]
    # the rebuild: the remembered candidate is dropped again, from the cache, with the same record
    again = tmp_path / "again"
    again.mkdir()
    self, events = coordinator(again, ["defaults", "cpp-gemm"])
    self.tuner.tuned("m--defaults", entry, None, 0.003, cached="local")
    self.tuner.cached_candidate(candidate_miss("m--cpp-gemm", "a" * 64), found, "local")
    lines = [e.message for e in events if isinstance(e, protocol.Info)]
    assert (
        "m: candidate cpp-gemm dropped at compile: the aoti backend failed: boom (remembered from an earlier build)"
        in lines
    )
    assert self.entries["m"]["tuning"]["candidates"] == first["candidates"][:2]
    assert isinstance(events[-1], protocol.Cached), "every candidate came from the cache"


def test_a_drop_another_machine_remembered_is_compiled_here(tmp_path: Path) -> None:
    self, events = coordinator(tmp_path, ["defaults", "cpp-gemm"])
    there = {"entry": {"tuning": {"dropped": "compile: boom", "machine": "another CPU; 64 CPUs; 64 threads"}}}
    assert self.tuner.cached_candidate(candidate_miss("m--cpp-gemm", "c" * 64), there, "local") is False
    assert not self.tuner.tunings["m"].dropped and not self.tuner.tunings["m"].cached


def test_all_candidates_remembered_as_failing_say_how_to_try_them_again(tmp_path: Path) -> None:
    self, events = coordinator(tmp_path, ["defaults"])
    dropped = {"entry": {"tuning": {"dropped": "verify: output: mismatch", "machine": tuning.machine()}}}
    self.tuner.cached_candidate(candidate_miss("m--defaults", "d" * 64), dropped, "local")
    (failed,) = [e for e in events if isinstance(e, protocol.Failed)]
    assert failed.message == (
        "no candidate compiled and verified (defaults: verify: output: mismatch); defaults (remembered from an "
        "earlier build): `hatch-aoti cache clear` tries them again"
    )


def test_a_time_cached_by_another_machine_is_taken_again_here_and_kept_for_this_one(tmp_path: Path) -> None:
    self, events = coordinator(tmp_path, ["defaults", "cpp-gemm"])
    entry = {"verification": {"passed": True, "tried": []}}
    here = {"entry": {**entry, "tuning": {"seconds": 0.002, "machine": tuning.machine()}}, "errors": None}
    there = {"entry": {**entry, "tuning": {"seconds": 0.001, "machine": "another CPU; 64 CPUs; 64 threads"}}}
    self.tuner.cached_candidate(candidate_miss("m--defaults", "e" * 64, entry), here, "local")
    self.tuner.cached_candidate(candidate_miss("m--cpp-gemm", "f" * 64, entry), there, "remote")
    found = self.tuner.tunings["m"]
    assert found.results["defaults"][2] == 0.002 and list(found.untimed) == ["cpp-gemm"], "to be timed, not compiled"
    assert "m" not in self.entries, "not kept before it is timed here"
    # timed here: kept in the local cache, so the next build on this machine takes it as it is
    self.tuner.write_note(candidate_miss("m--cpp-gemm", "f" * 64, entry), {"seconds": 0.004}, per_machine=True)
    (tmp_path / "again").mkdir()
    again, events = coordinator(tmp_path / "again", ["defaults", "cpp-gemm"])
    again.cache = self.cache
    again.tuner.cached_candidate(candidate_miss("m--defaults", "e" * 64, entry), here, "local")
    again.tuner.cached_candidate(candidate_miss("m--cpp-gemm", "f" * 64, entry), there, "remote")
    assert again.entries["m"]["tuning"]["candidates"][1] == {"candidate": "cpp-gemm", "ms": 4.0}
    assert isinstance(events[-1], protocol.Cached)


def test_a_time_is_taken_again_under_another_choice_of_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader packs by HATCH_AOTI_PACK, which changes a candidate's time: it is part of the machine."""
    monkeypatch.delenv("HATCH_AOTI_PACK", raising=False)
    default = tuning.machine()
    monkeypatch.setenv("HATCH_AOTI_PACK", "all")
    assert tuning.machine() == f"{default}; HATCH_AOTI_PACK=all"
    monkeypatch.setenv("HATCH_AOTI_PACK", "")
    assert tuning.machine() == default


def test_only_a_compile_that_would_fail_again_is_lasting() -> None:
    import subprocess

    from hatch_aoti.worker.helpers import lasting

    assert lasting(RuntimeError("C++ compile error: 'x' was not declared"))
    assert not lasting(MemoryError())
    assert not lasting(RuntimeError("g++: fatal error: Killed signal terminated program cc1plus"))
    try:
        try:
            raise subprocess.CalledProcessError(-9, ["g++"])
        except subprocess.CalledProcessError as exc:
            raise RuntimeError("the compile failed") from exc
    except RuntimeError as exc:
        assert not lasting(exc)
    assert not lasting(OSError(28, "No space left on device"))


# -- a real tuned build ---------------------------------------------------------------------

MODELS = """
    import torch
    from torch import nn

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32), nn.LayerNorm(32)).eval()
"""
HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti]
    tune = true

    [tool.hatch.build.targets.wheel.hooks.aoti.models.mlp]
    factory = "tunepkg.models:mlp"
    inputs = [{ shape = [8, 64] }]
    precision = ["bfloat16", "float32"]  # each variant tuned on its own
"""


@pytest.fixture(scope="session")
def tuned_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    project = write_project(tmp_path_factory.mktemp("tune") / "proj", "tunepkg", HOOK, {"models.py": MODELS})
    proc = build_no_isolation(project, project / "dist")
    (wheel,) = (project / "dist").glob("*.whl")
    return project, wheel, proc.stdout + proc.stderr


@pytest.mark.integration
def test_a_tuned_build_times_every_candidate_and_keeps_one(
    tuned_build: tuple[Path, Path, str], runtime: Runtime, tmp_path: Path
) -> None:
    import torch

    project, wheel, log = tuned_build
    for label in ("mlp@bfloat16", "mlp"):  # each variant tuned on its own
        assert f"aoti: {label}: tuning 4 candidates: defaults, cpp-gemm, concat-linear, no-freezing" in log, log
        for name in ("defaults", "cpp-gemm", "concat-linear", "no-freezing"):
            assert re.search(rf"^aoti: {label}: candidate {name}: [0-9.]+ ms per call, verified$", log, re.M), log
        assert re.search(rf"^aoti: \[1/1\] {label}: timing its candidates$", log, re.M), log
        assert re.search(rf"^aoti: {label}: tuned: kept [a-z-]+ \(times taken on this machine\)$", log, re.M), log
    assert re.search(r"^aoti: 1 model in [0-9.]+s \(2 variants: 2 compiled\)$", log, re.M), log
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        names = zf.namelist()
    assert not [n for n in names if tuning.SEPARATOR in n], "only the kept candidate ships"
    sys.path.insert(0, str(project))
    try:
        from tunepkg.models import mlp
    finally:
        sys.path.remove(str(project))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    result = runtime.json(
        f"""
        import json, sys; sys.path.insert(0, {str(site)!r})
        import torch
        from tunepkg import compiled
        y = compiled.load("mlp", precision="float32")(torch.load({str(tmp_path / "x.pt")!r}))
        torch.save(y, {str(tmp_path / "y.pt")!r})
        print(json.dumps(compiled.info("mlp", precision="float32")["tuning"]))
        """
    )
    assert f"aoti: mlp: tuned: kept {result['chosen']} (times taken on this machine)" in log
    manifest = json.loads((site / "tunepkg" / "_aoti" / "manifest.json").read_text(encoding="utf-8"))
    bfloat16 = manifest["models"]["mlp"]  # listed first
    assert bfloat16["precision"] == "bfloat16" and bfloat16["variants"][0]["precision"] == "float32"
    assert f"aoti: mlp@bfloat16: tuned: kept {bfloat16['tuning']['chosen']} (times taken" in log
    assert [r["candidate"] for r in result["candidates"]] == ["defaults", "cpp-gemm", "concat-linear", "no-freezing"]
    times = {r["candidate"]: r["ms"] for r in result["candidates"]}
    assert times[result["chosen"]] == min(times.values()) and all(t > 0 for t in times.values()), result
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "y.pt"), mlp()(x), rtol=1e-4, atol=1e-5)


@pytest.mark.integration
def test_a_tuned_rebuild_takes_every_candidate_from_the_cache(tuned_build: tuple[Path, Path, str]) -> None:
    project, wheel, _ = tuned_build
    out = project / "dist-again"
    proc = build_no_isolation(project, out, env={**os.environ})
    log = proc.stdout + proc.stderr
    assert log.count("ms per call, from cache") == 8 and "aoti: [1/1] mlp@bfloat16: from cache in" in log, log
    assert re.search(r"^aoti: 1 model in [0-9.]+s \(2 variants: 2 from the cache\)$", log, re.M), log
    (again,) = out.glob("*.whl")
    assert again.read_bytes() == wheel.read_bytes()
    with zipfile.ZipFile(again) as zf:
        manifest = json.loads(zf.read("tunepkg/_aoti/manifest.json"))
    entry = manifest["models"]["mlp"]
    assert entry["tuning"]["chosen"] and entry["variants"][0]["tuning"]["chosen"], "each variant's own"


@pytest.mark.integration
def test_inspect_shows_each_candidate_and_the_one_kept(
    tuned_build: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from hatch_aoti.cli import main

    assert main(["inspect", str(tuned_build[1])]) == 0
    text = capsys.readouterr().out
    assert "tuned (times from the build machine, the example inputs):" in text, text
    assert re.search(r"^ +[a-z-]+: [0-9.]+ ms per call \(kept\)$", text, re.M), text
    assert text.count(" ms per call") == 4
