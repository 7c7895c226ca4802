"""The compile cache: storage rules (no torch) and real rebuilds that hit or miss."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tempfile
import zipfile
from pathlib import Path

import pytest
from conftest import S3, Runtime, build_no_isolation, closed_port, debug_sections, write_project

from hatch_aoti.pipeline.artifacts import sha256
from hatch_aoti.store import cache as cache_mod
from hatch_aoti.store.cache import CompileCache

M = "tool.hatch.build.targets.wheel.hooks.aoti.models"

# -- storage -------------------------------------------------------------------------


def make_artifact(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "data" / "model.so").write_bytes(b"\x7fELF" + b"x" * 1000)
    (root / "archive_format").write_text("pt2")
    return root


def entry_dir(root: Path, key: str) -> Path:
    return root / "v2" / "entries" / key[:2] / key


def test_store_then_lookup_round_trips(tmp_path: Path) -> None:
    store = CompileCache(tmp_path / "cache")
    assert store.store("ab" * 32, make_artifact(tmp_path / "a"), {"entry": {"sha256": "x"}})
    record = store.lookup("ab" * 32, tmp_path / "out")
    assert record is not None and record["entry"] == {"sha256": "x"}
    assert (tmp_path / "out" / "data" / "model.so").read_bytes().startswith(b"\x7fELF")
    assert store.lookup("cd" * 32, tmp_path / "out2") is None
    assert list((tmp_path / "cache" / "v2" / "tmp").iterdir()) == [], "nothing half-written stays"
    assert store.entries() == [entry_dir(tmp_path / "cache", "ab" * 32)]


def test_a_second_store_of_the_same_key_keeps_the_first(tmp_path: Path) -> None:
    store = CompileCache(tmp_path / "cache")
    assert store.store("ab" * 32, make_artifact(tmp_path / "a"), {"entry": {"n": 1}})
    assert not store.store("ab" * 32, make_artifact(tmp_path / "b"), {"entry": {"n": 2}})
    assert store.lookup("ab" * 32, tmp_path / "out")["entry"] == {"n": 1}
    assert list((tmp_path / "cache" / "v2" / "tmp").iterdir()) == []


@pytest.mark.parametrize("damage", ["truncate", "remove", "add", "entry"])
def test_damaged_entry_is_discarded(tmp_path: Path, damage: str) -> None:
    store = CompileCache(tmp_path / "cache")
    key = "ef" * 32
    store.store(key, make_artifact(tmp_path / "a"), {"entry": {}})
    entry = entry_dir(tmp_path / "cache", key)
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


def test_killed_writers_leave_nothing_accepted_and_are_swept(tmp_path: Path) -> None:
    """A killed build's half-written entry is never read, and the next store removes it;
    an entry another live build is writing is left alone."""
    from hatch_aoti.store.owned import OwnedDir

    store = CompileCache(tmp_path / "cache")
    tmp_root = tmp_path / "cache" / "v2" / "tmp"
    dead = tmp_root / "entry-dead"
    make_artifact(dead / "entry" / "artifact")  # what a killed build leaves: unlocked, never renamed
    live = OwnedDir.create(tmp_root, "entry-")  # a concurrent build, still writing
    try:
        assert store.lookup("12" * 32, tmp_path / "out") is None
        store.store("34" * 32, make_artifact(tmp_path / "a"), {"entry": {}})
        assert not dead.exists(), "the next store sweeps what killed builds left"
        assert live.path.exists(), "a live build's entry in progress is not touched"
    finally:
        live.release()


def test_the_cache_keeps_to_its_cap_by_last_use_and_never_takes_an_entry_in_use(tmp_path: Path) -> None:
    import time

    root = tmp_path / "cache"
    other = CompileCache(root)  # another build, still running: it holds the entries it stored...
    for key in ("aa", "bb", "cc"):
        other.store(key * 32, make_artifact(tmp_path / key), {"entry": {}})
        time.sleep(0.01)
    for key in ("aa", "cc"):  # ...but uses only "bb" now
        os.close(other._held.pop(key * 32))
    size = json.loads((entry_dir(root, "aa" * 32) / "entry.json").read_text())["size"]

    ours = CompileCache(root, max_size=3 * size)
    assert ours.lookup("aa" * 32, tmp_path / "out") is not None  # "aa" is the most recently used now
    ours.store("dd" * 32, make_artifact(tmp_path / "dd"), {"entry": {}})  # four entries, room for three
    assert {p.name[:2] for p in ours.entries()} == {"aa", "bb", "dd"}, "'cc', used longest ago, went"

    third = CompileCache(root, max_size=size)
    assert third.evict() == [], "every entry left is in use by one build or another"
    for fd in ours._held.values():
        os.close(fd)
    ours._held.clear()
    assert {p.name[:2] for p in third.evict()} == {"aa", "dd"}
    assert [p.name[:2] for p in third.entries()] == ["bb"], "the one in use stays, over the cap or not"


def test_the_cap_comes_from_the_environment() -> None:
    assert cache_mod.from_env({"HATCH_AOTI_CACHE_MAX_SIZE": "512MB"}).max_size == 512 * 2**20
    assert cache_mod.from_env({"HATCH_AOTI_CACHE_MAX_SIZE": "2 GiB"}).max_size == 2 * 2**30
    assert cache_mod.from_env({}).max_size == cache_mod.DEFAULT_MAX_SIZE
    with pytest.raises(ValueError, match="HATCH_AOTI_CACHE_MAX_SIZE must be a size"):
        cache_mod.from_env({"HATCH_AOTI_CACHE_MAX_SIZE": "lots"})


def test_without_a_cache_no_key_is_computed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """HATCH_AOTI_NO_CACHE: the coordinator never computes a key (it costs a pass over the weights)."""
    torch = pytest.importorskip("torch")
    from hatch_aoti.pipeline.protocol import Cached, Job
    from hatch_aoti.settings.resolve import parse_settings
    from hatch_aoti.worker import fingerprint
    from hatch_aoti.worker.checks import Prepared
    from hatch_aoti.worker.coordinator import Coordinator
    from hatch_aoti.worker.inputs import plan_declared

    def no_key(*args, **kwargs):
        raise AssertionError("a key was computed without a cache")

    monkeypatch.setattr(fingerprint, "cache_key", no_key)
    (spec,) = parse_settings(
        {"models": {"m": {"factory": "a:b", "inputs": [{"shape": [2, 3]}]}}}, machine="x86_64", flags=set()
    ).models
    model = Prepared(spec, torch.nn.Linear(3, 2), plan_declared(spec, ["input"]))
    job = Job([spec], str(tmp_path), "compiled", "p", [], str(tmp_path), None, None, None, 1)
    events = []
    parent = type("Parent", (), {"emit": lambda self, event: events.append(event)})()
    (miss,) = Coordinator(job, parent).export_and_look_up(model)
    assert miss.key == "" and not any(isinstance(e, Cached) for e in events)


def test_keys_name_the_loader_and_factory_only_for_backends_that_compile_with_them(tmp_path: Path) -> None:
    """Precompiled code names the loader's ``_call``: another loader must not reuse it. An aoti
    library names nothing of the project, so projects share its entries."""
    torch = pytest.importorskip("torch")
    from hatch_aoti.pipeline.protocol import Job
    from hatch_aoti.settings.resolve import parse_settings
    from hatch_aoti.worker.checks import Prepared
    from hatch_aoti.worker.coordinator import Coordinator
    from hatch_aoti.worker.inputs import plan_declared

    parent = type("Parent", (), {"emit": lambda self, event: None})()

    def key(backend: str, loader: str = "compiled", factory: str = "a:b") -> str:
        table = {"models": {"m": {"factory": factory, "backend": backend, "inputs": [{"shape": [2, 3]}]}}}
        (spec,) = parse_settings(table, machine="x86_64", flags=set()).models
        torch.manual_seed(0)
        model = Prepared(spec, torch.nn.Linear(3, 2), plan_declared(spec, ["input"]))
        job = Job([spec], str(tmp_path), loader, "p", [], str(tmp_path), str(tmp_path / "cache"), 2**30, None, 1)
        (miss,) = Coordinator(job, parent).export_and_look_up(model)
        return miss.key

    assert key("aoti") == key("aoti", loader="aot") == key("aoti", factory="c:d")
    assert len({key("precompile"), key("precompile", loader="aot"), key("precompile", factory="c:d")}) == 3


def test_unusable_cache_location_is_a_miss_and_store_raises_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    store = CompileCache(blocker)
    assert store.lookup("ab" * 32, tmp_path / "out") is None
    with pytest.raises(OSError):  # the coordinator turns this into a warning, not a failed build
        store.store("ab" * 32, make_artifact(tmp_path / "a"), {"entry": {}})


def test_environment_controls(tmp_path: Path) -> None:
    assert cache_mod.from_env({"HATCH_AOTI_NO_CACHE": "1"}) is None
    assert cache_mod.from_env({"HATCH_AOTI_CACHE_DIR": str(tmp_path)}).root == tmp_path
    assert cache_mod.from_env({"HATCH_AOTI_NO_CACHE": "0", "HATCH_AOTI_CACHE_DIR": str(tmp_path)}) is not None
    default = cache_mod.from_env({})
    assert default is not None and "hatch-aoti" in str(default.root)


def test_a_cache_others_can_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    assert cache_mod.untrusted(root) is None, "not there yet: it will be made private"
    root.mkdir(mode=0o700)
    assert cache_mod.untrusted(root) is None
    root.chmod(0o770)
    assert "other users can write to it (mode 770)" in cache_mod.untrusted(root)
    root.chmod(0o707)
    assert "other users can write" in cache_mod.untrusted(root)
    root.chmod(0o700)
    assert "belongs to another user" in cache_mod.untrusted(root, uid=os.getuid() + 1)
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    assert "world-writable without the sticky bit" in cache_mod.untrusted(open_parent / "cache")
    open_parent.chmod(0o1777)  # like /tmp
    assert cache_mod.untrusted(open_parent / "cache") is None


def test_the_cache_is_made_private_whatever_the_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first build makes the root 700 before anything (the bytecode store first) writes in it."""
    from hatch_aoti.pipeline import core as pipeline
    from hatch_aoti.worker import bytecode

    monkeypatch.setenv("HATCH_AOTI_CACHE_DIR", str(tmp_path / "home" / "cache"))
    old = os.umask(0o002)
    try:
        store = pipeline.usable_cache(pipeline.Reporter())
        bytecode._write(store.root / "bytecode" / "ab" / "ab12", compile("x = 1", "x.py", "exec"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert cache_mod.untrusted(store.root) is None
    store.root.chmod(0o755)  # left by an older version: others could reach what builds write inside
    assert pipeline.usable_cache(pipeline.Reporter()) is not None
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700


def test_clean_removes_leftover_staging_not_the_cache_nor_live_builds(tmp_path: Path) -> None:
    from hatch_aoti.frontends.hatch import AotiBuildHook
    from hatch_aoti.pipeline.core import _stage_prefix, open_stage

    hook = AotiBuildHook(str(tmp_path), {}, None, None, str(tmp_path / "dist"), "wheel")
    leftover = Path(tempfile.mkdtemp(prefix=_stage_prefix(tmp_path)))  # a killed build's: not locked
    live = open_stage(tmp_path)  # a build of the same project, still running
    other = Path(tempfile.mkdtemp(prefix="hatch-aoti-000000000000-"))
    shared = tmp_path / "cache"
    shared.mkdir()
    try:
        hook.clean(["standard"])
        assert not leftover.exists() and other.exists() and shared.exists()
        assert live.path.exists(), "a running build's staging is never removed"
    finally:
        live.release()
        other.rmdir()


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
    inputs = [{{ shape = [2, 6] }}]
    inductor-configs = {{ {configs} }}
"""
BASE = {"seed": 0, "forward": "self.lin(x)", "configs": ""}


@pytest.fixture(scope="module")
def cached_builds(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch):
    cache_dir = tmp_path_factory.mktemp("aoti-cache")
    monkeypatch_module.setenv("HATCH_AOTI_CACHE_DIR", str(cache_dir))
    monkeypatch_module.delenv("HATCH_AOTI_NO_CACHE", raising=False)
    counter = iter(range(1000))

    def build(env: dict[str, str] | None = None, **changes) -> tuple[str, Path]:
        values = {**BASE, **changes}
        root = tmp_path_factory.mktemp("cacheproj") / f"p{next(counter)}"
        write_project(root, "cachepkg", HOOK.format(**values), {"models.py": MODELS.format(**values)})
        proc = build_no_isolation(root, root / "dist", env={**os.environ, **(env or {})})
        (wheel,) = (root / "dist").glob("*.whl")
        return proc.stdout + proc.stderr, wheel

    return build, cache_dir


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def wheel_matches_eager(runtime: Runtime, wheel: Path, tmp_path: Path) -> float:
    """Unpack the wheel beside a runtime venv without hatch-aoti and compare with eager (its own models.py)."""
    target = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    proc = runtime.run(
        f"""
        import sys; sys.path.insert(0, {str(target)!r})
        import torch
        from cachepkg import compiled
        from cachepkg.models import build
        x = torch.randn(2, 6)
        with torch.inference_mode():
            print((compiled.load("net")(x) - build()(x)).abs().max().item())
        """
    )
    return float(proc.stdout.split()[-1])


@pytest.mark.integration
def test_rebuilds_hit_and_changes_or_damage_miss(cached_builds, runtime: Runtime, tmp_path: Path, s3: S3) -> None:
    """Real rebuilds, with the remote tier on S3 (moto's server): no change hits, locally or from the
    remote tier on a machine with an empty cache; damage and new settings miss and ship the new model;
    a damaged remote entry and a store that is down never fail a build nor reach a wheel.

    That changes of weights, code or inputs change the key is unit-tested (test_keys.py), without compiling.
    """
    build, cache_dir = cached_builds
    bucket = s3.bucket()
    url = f"s3://{bucket}/fleet"
    fleet = {**s3.env, "HATCH_AOTI_REMOTE_CACHE": url}
    first, cold = build(fleet)
    assert "aoti: [1/1] net: compiled in" in first and f"remote cache: {url} (read-write)" in first
    uploaded = bucket_objects(s3, bucket)
    assert len([k for k in uploaded if "/entries/" in k]) == 1, "compiled and verified here, then uploaded"
    again, wheel = build(fleet)
    assert "aoti: [1/1] net: from cache in" in again and "compiled in" not in again
    assert wheel.read_bytes() == cold.read_bytes(), "a wheel from the cache is the wheel that was compiled"
    assert wheel_matches_eager(runtime, wheel, tmp_path / "same") < 1e-6

    output, wheel = build({**fleet, "HATCH_AOTI_CACHE_DIR": str(tmp_path / "empty")})  # the next machine
    assert "aoti: [1/1] net: from the remote cache in" in output and "compiled in" not in output, output
    assert wheel.read_bytes() == cold.read_bytes(), "a wheel from the remote tier is the wheel that was compiled"
    assert bucket_objects(s3, bucket) == uploaded, "a hit writes nothing"

    (library,) = (cache_dir / "v2" / "entries").rglob("*.so")
    blob, original = f"fleet/v2/blobs/{sha256(library)[:2]}/{sha256(library)}", library.read_bytes()
    with library.open("r+b") as f:
        f.truncate(100)
    flipped = original[:-1] + bytes([original[-1] ^ 1])  # damaged remotely too: one bit, the same size
    s3.client().put_object(Bucket=bucket, Key=blob, Body=flipped)
    damaged = bucket_objects(s3, bucket)
    output, wheel = build({**fleet, "HATCH_AOTI_REMOTE_CACHE_MODE": "read-only"})
    assert "aoti: [1/1] net: compiled in" in output, "a damaged entry is rebuilt, never shipped"
    assert "the remote compile cache's entry is damaged" in output and "does not match its digest" in output
    assert bucket_objects(s3, bucket) == damaged, "a read-only build writes nothing"
    assert wheel_matches_eager(runtime, wheel, tmp_path / "rebuilt") < 1e-6
    (rebuilt,) = (cache_dir / "v2" / "entries").rglob("*.so")
    assert os.path.getsize(rebuilt) > 100

    down = {**fleet, "AWS_ENDPOINT_URL": closed_port(), "HATCH_AOTI_REMOTE_CACHE_TIMEOUT": "5"}
    output, wheel = build(down, configs='"aot_inductor.enable_line_tables" = true')
    assert "aoti: [1/1] net: compiled in" in output, "a change of settings must miss the cache"
    assert output.count(f"the remote compile cache at {url} failed") == 1, "a store that is down: said once"
    assert wheel_matches_eager(runtime, wheel, tmp_path / "configs") < 1e-6, "the wheel holds the new model"
    assert debug_sections_in(wheel, tmp_path / "lines"), "the user's setting wins over hatch-aoti's default"
    records = [json.loads(p.read_text()) for p in (cache_dir / "v2" / "entries").rglob("entry.json")]
    assert len(records) == 2 and all(r["entry"]["verification"]["passed"] for r in records)


def bucket_objects(s3: S3, bucket: str) -> dict[str, str]:
    """Each object's key and ETag: what changes if anything is written."""
    listing = s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in listing}


def debug_sections_in(wheel: Path, dest: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        (library,) = [n for n in zf.namelist() if n.endswith(".so")]
        zf.extract(library, dest)
    return debug_sections(dest / library)


PAIR_MODELS = """
    import torch
    from torch import nn

    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x)   # random by design: compiled != eager

    def good():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 4), nn.ReLU())

    def noisy():
        return Noisy()
"""
PAIR_HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti.models.good]
    factory = "pairpkg.models:good"
    inputs = [{{ shape = [2, 5] }}]

    [tool.hatch.build.targets.wheel.hooks.aoti.models.noisy]
    factory = "pairpkg.models:noisy"
    inputs = [{{ shape = [64] }}]
    verify = {verify}
"""


@pytest.mark.integration
def test_a_failing_model_does_not_cost_the_others_their_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One model fails verification (in a compile helper): the other is cached anyway, the
    failure names the model, its input set and its errors; fixing it recompiles only it."""
    monkeypatch.setenv("HATCH_AOTI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HATCH_AOTI_JOBS", "2")

    def build(verify: str, label: str) -> subprocess.CompletedProcess[str]:
        root = write_project(tmp_path / label, "pairpkg", PAIR_HOOK.format(verify=verify), {"models.py": PAIR_MODELS})
        return build_no_isolation(root, root / "dist", check=False)

    failed = build("true", "first")
    text = failed.stdout + failed.stderr
    assert failed.returncode != 0 and "Traceback" not in text
    assert not list((tmp_path / "first").glob("dist/*.whl")), "no wheel on failure"
    assert "aoti: 2 models to compile: 2 processes in parallel" in text
    assert "aoti: [1/2] good: compiled in" in text
    assert f"model 'noisy' ({M}.noisy) failed at verify" in text
    assert "differs from eager on example inputs [[64]]" in text and "max abs err" in text
    assert len(CompileCache(tmp_path / "cache").entries()) == 1, "the model that passed is kept"

    fixed = build("false", "fixed")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "aoti: [1/2] good: from cache in" in fixed.stderr and "aoti: [2/2] noisy: compiled in" in fixed.stderr


def test_the_parents_of_the_resolved_cache_are_checked_and_group_writable_ones_refused(tmp_path: Path) -> None:
    """As ssh does: a parent its group can write may swap the cache, and a symlink does not hide where it is."""
    shared = tmp_path / "shared"
    (shared / "cache").mkdir(parents=True, mode=0o700)
    others = [g for g in os.getgroups() if g != os.getgid()]
    try:  # a group of others (the user's own private group, which umask 002 gives, may write)
        os.chown(shared, -1, others[0] if others else 54321)
    except PermissionError:
        pytest.skip("this user belongs to no group but its own")
    shared.chmod(0o770)
    assert "its group can replace it: " in cache_mod.untrusted(shared / "cache")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "link").symlink_to(shared / "cache")
    assert f"{shared} above it is group-writable" in cache_mod.untrusted(private / "link")
    shared.chmod(0o700)
    assert cache_mod.untrusted(private / "link") is None
