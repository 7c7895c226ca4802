"""The compile cache: storage rules (no torch) and real rebuilds that hit or miss."""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

import pytest
from conftest import Runtime, build_no_isolation, debug_sections, write_project

from hatch_aoti import cache as cache_mod
from hatch_aoti.cache import CompileCache

# -- storage -------------------------------------------------------------------------


def make_artifact(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "data" / "model.so").write_bytes(b"\x7fELF" + b"x" * 1000)
    (root / "archive_format").write_text("pt2")
    return root


def test_store_then_lookup_round_trips(tmp_path: Path) -> None:
    store = CompileCache(tmp_path / "cache")
    store.store("ab" * 32, make_artifact(tmp_path / "a"), {"entry": {"sha256": "x"}})
    record = store.lookup("ab" * 32, tmp_path / "out")
    assert record is not None and record["entry"] == {"sha256": "x"}
    assert (tmp_path / "out" / "data" / "model.so").read_bytes().startswith(b"\x7fELF")
    assert store.lookup("cd" * 32, tmp_path / "out2") is None
    assert list((tmp_path / "cache" / "v1" / "tmp").iterdir()) == [], "nothing half-written stays"


@pytest.mark.parametrize("damage", ["truncate", "remove", "add", "entry"])
def test_damaged_entry_is_discarded(tmp_path: Path, damage: str) -> None:
    store = CompileCache(tmp_path / "cache")
    key = "ef" * 32
    store.store(key, make_artifact(tmp_path / "a"), {"entry": {}})
    entry = tmp_path / "cache" / "v1" / key[:2] / key
    if damage == "truncate":
        with (entry / "artifact" / "data" / "model.so").open("r+b") as f:
            f.truncate(10)
    elif damage == "remove":
        (entry / "artifact" / "archive_format").unlink()
    elif damage == "add":
        (entry / "artifact" / "extra").write_text("?")
    else:
        (entry / "entry.json").write_text("{not json")
    assert store.lookup(key, tmp_path / "out") is None
    assert not entry.exists(), "a damaged entry is removed so the next build rebuilds it"
    assert not (tmp_path / "out").exists()


def test_interrupted_write_is_never_read(tmp_path: Path) -> None:
    store = CompileCache(tmp_path / "cache")
    key = "12" * 32
    half = tmp_path / "cache" / "v1" / "tmp" / "deadbeef"
    make_artifact(half / "artifact")  # what a killed build leaves: no entry.json, not renamed
    assert store.lookup(key, tmp_path / "out") is None


def test_unusable_cache_location_is_a_miss_and_store_raises_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    store = CompileCache(blocker)
    assert store.lookup("ab" * 32, tmp_path / "out") is None
    with pytest.raises(OSError):  # the worker turns this into a warning, not a failed build
        store.store("ab" * 32, make_artifact(tmp_path / "a"), {"entry": {}})


def test_environment_controls(tmp_path: Path) -> None:
    assert cache_mod.from_env({"HATCH_AOTI_NO_CACHE": "1"}) is None
    assert cache_mod.from_env({"HATCH_AOTI_CACHE_DIR": str(tmp_path)}).root == tmp_path
    assert cache_mod.from_env({"HATCH_AOTI_NO_CACHE": "0", "HATCH_AOTI_CACHE_DIR": str(tmp_path)}) is not None
    default = cache_mod.from_env({})
    assert default is not None and "hatch-aoti" in str(default.root)


def test_clean_removes_leftover_staging_not_the_cache(tmp_path: Path) -> None:
    from hatch_aoti.plugin import AotiBuildHook

    hook = AotiBuildHook(str(tmp_path), {}, None, None, str(tmp_path / "dist"), "wheel")
    leftover = Path(tempfile.mkdtemp(prefix=hook._stage_prefix()))
    other = Path(tempfile.mkdtemp(prefix="hatch-aoti-000000000000-"))
    shared = tmp_path / "cache"
    shared.mkdir()
    hook.clean(["standard"])
    assert not leftover.exists() and other.exists() and shared.exists()
    other.rmdir()


def test_recent_keys_round_trip_and_tolerate_damage(tmp_path: Path) -> None:
    store = CompileCache(tmp_path / "cache")
    assert store.recall("demo") == {}
    store.remember("demo", {"a": "11" * 32, "b": "22" * 32})
    store.remember("other", {"a": "33" * 32})
    assert store.recall("demo") == {"a": "11" * 32, "b": "22" * 32}
    (recent,) = [p for p in (tmp_path / "cache" / "v1" / "recent").iterdir() if "33" not in p.read_text()]
    recent.write_text("{half")
    assert store.recall("demo") == {}, "a damaged record is no record"
    assert [p.suffix for p in recent.parent.iterdir()] == [".json", ".json"], "no temp files left"


def dispatch_for(tmp_path: Path, names: list[str], jobs: int, cache: CompileCache | None):
    from hatch_aoti.config import parse_settings
    from hatch_aoti.dispatch import Dispatch

    models = {n: {"factory": "pkg.models:build", "inputs": [{"shape": [2, 3]}]} for n in names}
    settings = parse_settings({"models": models})
    return Dispatch(models=list(settings.models), stage=tmp_path, loader="compiled", sys_path=[], cwd=str(tmp_path),
                    cache=cache, report=print, project="demo", jobs=jobs)  # fmt: skip


def test_one_worker_when_every_model_was_cached_at_the_last_build(tmp_path: Path) -> None:
    store = CompileCache(tmp_path / "cache")
    names = ["a", "b", "c"]

    def group_sizes() -> list[int]:
        return [len(g) for g in dispatch_for(tmp_path, names, 2, store)._initial_groups()]

    assert group_sizes() == [2, 1], "no record: spread over the cores from the start"
    store.remember("demo", {n: n * 64 for n in names})
    assert group_sizes() == [2, 1], "recorded keys whose entries are gone: spread"
    for n in names:
        store.store(n * 64, make_artifact(tmp_path / f"art-{n}"), {"entry": {}})
    assert group_sizes() == [3], "all entries there: one worker imports torch once"
    store.remember("demo", {"a": "a" * 64, "b": "b" * 64})
    assert group_sizes() == [2, 1], "a model with no record: spread"
    assert [len(g) for g in dispatch_for(tmp_path, names, 2, None)._initial_groups()] == [2, 1]


@pytest.mark.parametrize(
    ("misses", "idle", "shares"),
    [
        (["a"], 3, [["a"]]),
        (["a", "b", "c"], 0, [["a", "b", "c"]]),
        (["a", "b", "c"], 1, [["a", "c"], ["b"]]),
        (["a", "b", "c"], 5, [["a"], ["b"], ["c"]]),
        ([], 2, [[]]),
    ],
)
def test_misses_are_shared_within_the_job_limit(misses: list[str], idle: int, shares: list[list[str]]) -> None:
    from hatch_aoti.dispatch import share_out

    assert share_out(misses, idle) == shares


# -- real rebuilds -------------------------------------------------------------------

MODELS = """
    import torch
    from torch import nn

    SEED = {seed}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            return {forward}

    def build():
        torch.manual_seed(SEED)
        return Net()
"""
HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti.models.net]
    factory = "cachepkg.models:build"
    inputs = [{{ shape = [{batch}, 6] }}]
    inductor-configs = {{ {configs} }}
"""
BASE = {"seed": 0, "forward": "self.lin(x)", "batch": 2, "configs": ""}


@pytest.fixture(scope="module")
def cached_builds(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch):
    cache_dir = tmp_path_factory.mktemp("aoti-cache")
    monkeypatch_module.setenv("HATCH_AOTI_CACHE_DIR", str(cache_dir))
    monkeypatch_module.delenv("HATCH_AOTI_NO_CACHE", raising=False)
    counter = iter(range(1000))

    def build(**changes) -> tuple[str, Path]:
        values = {**BASE, **changes}
        root = tmp_path_factory.mktemp("cacheproj") / f"p{next(counter)}"
        write_project(root, "cachepkg", HOOK.format(**values), {"models.py": MODELS.format(**values)})
        proc = build_no_isolation(root, root / "dist")
        (wheel,) = (root / "dist").glob("*.whl")
        return proc.stdout + proc.stderr, wheel

    return build, cache_dir


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def wheel_matches_eager(runtime: Runtime, wheel: Path, tmp_path: Path, batch: int = 2) -> float:
    """Unpack the wheel beside a runtime venv without hatch-aoti and compare with eager."""
    target = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    proc = runtime.run(
        f"""
        import sys; sys.path.insert(0, {str(target)!r})
        import torch
        from cachepkg import compiled
        from cachepkg.models import build
        x = torch.randn({batch}, 6)
        with torch.inference_mode():
            print((compiled.load("net")(x) - build()(x)).abs().max().item())
        """
    )
    return float(proc.stdout.split()[-1])


@pytest.mark.integration
def test_unchanged_rebuild_hits_and_changes_miss(cached_builds, runtime: Runtime, tmp_path: Path) -> None:
    build, _ = cached_builds
    first, _ = build()
    assert "aoti: net: compiled in" in first
    again, wheel = build()
    assert "aoti: net: from cache in" in again and "compiled in" not in again
    assert wheel_matches_eager(runtime, wheel, tmp_path / "same") < 1e-6

    for label, change in {
        "weights": {"seed": 1},
        "code": {"forward": "torch.relu(self.lin(x))"},
        "inductor configs": {"configs": '"aot_inductor.enable_line_tables" = true'},
        "input spec": {"batch": 3},
    }.items():
        output, wheel = build(**change)
        assert "aoti: net: compiled in" in output, f"a change of {label} must miss the cache"
        batch = change.get("batch", 2)
        err = wheel_matches_eager(runtime, wheel, tmp_path / label.replace(" ", "_"), batch)
        assert err < 1e-6, f"after a change of {label} the wheel must hold the new model"
        if label == "inductor configs":  # the user's setting wins over hatch-aoti's default
            assert debug_sections_in(wheel, tmp_path / "lines"), "line tables were asked for"


def debug_sections_in(wheel: Path, dest: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        (library,) = [n for n in zf.namelist() if n.endswith(".so")]
        zf.extract(library, dest)
    return debug_sections(dest / library)


@pytest.mark.integration
def test_truncated_entry_is_rebuilt(
    cached_builds, runtime: Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build, _ = cached_builds
    cache_dir = tmp_path / "own-cache"
    monkeypatch.setenv("HATCH_AOTI_CACHE_DIR", str(cache_dir))
    build(seed=7)
    libraries = [p for p in (cache_dir / "v1").rglob("*.so") if p.relative_to(cache_dir / "v1").parts[0] != "tmp"]
    assert libraries
    for library in libraries:
        with library.open("r+b") as f:
            f.truncate(100)
    output, wheel = build(seed=7)
    assert "aoti: net: compiled in" in output
    assert wheel_matches_eager(runtime, wheel, tmp_path, 2) < 1e-6
    records = [json.loads(p.read_text()) for p in (cache_dir / "v1").rglob("entry.json")]
    assert all(r["entry"]["verification"]["passed"] for r in records), "entries record their verification"
    (rebuilt,) = (cache_dir / "v1").rglob("*.so")
    assert os.path.getsize(rebuilt) > 100


PAIR_MODELS = """
    import torch
    from torch import nn

    SEED = {seed}

    def _net(width):
        torch.manual_seed(SEED + width)
        return nn.Sequential(nn.Linear(width, 4), nn.ReLU())

    def build_a():
        return _net(5)

    def build_b():
        return _net(7)
"""
PAIR_HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti.models.a]
    factory = "pairpkg.models:build_a"
    inputs = [{ shape = [2, 5] }]

    [tool.hatch.build.targets.wheel.hooks.aoti.models.b]
    factory = "pairpkg.models:build_b"
    inputs = [{ shape = [2, 7] }]
"""


@pytest.mark.integration
def test_cached_rebuild_runs_one_worker_and_shares_out_misses(
    runtime: Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both models cached last time: one worker starts; when both then miss, it hands one on."""
    monkeypatch.setenv("HATCH_AOTI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HATCH_AOTI_JOBS", "2")

    def build(seed: int, label: str) -> tuple[str, Path]:
        root = write_project(tmp_path / label, "pairpkg", PAIR_HOOK, {"models.py": PAIR_MODELS.format(seed=seed)})
        proc = build_no_isolation(root, root / "dist")
        (wheel,) = (root / "dist").glob("*.whl")
        return proc.stdout + proc.stderr, wheel

    first, _ = build(0, "first")
    assert first.count("compiled in") == 2 and "missed the cache" not in first, "no record: both start at once"
    again, _ = build(0, "again")
    assert again.count("from cache in") == 2 and "missed the cache" not in again
    changed, wheel = build(1, "changed")
    assert "2 models missed the cache: compiling them in 2 workers" in changed, changed
    assert changed.count("compiled in") == 2
    target = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    errors = runtime.json(
        f"""
        import json, sys; sys.path.insert(0, {str(target)!r})
        import torch
        from pairpkg import compiled, models
        errs = {{}}
        for name, width, build in (("a", 5, models.build_a), ("b", 7, models.build_b)):
            x = torch.randn(2, width)
            with torch.inference_mode():
                errs[name] = (compiled.load(name)(x) - build()(x)).abs().max().item()
        print(json.dumps(errs))
        """
    )
    assert errors["a"] < 1e-6 and errors["b"] < 1e-6, errors
