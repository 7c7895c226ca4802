"""The build's process protocols, with fake processes instead of torch (no compiling)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

from hatch_aoti.pipeline import protocol
from hatch_aoti.pipeline.children import Child, watch
from hatch_aoti.pipeline.core import BuildFailed, Coordination, Reporter
from hatch_aoti.pipeline.protocol import HelperJob, Task
from hatch_aoti.settings.reader import ConfigError
from hatch_aoti.settings.resolve import parse_settings
from hatch_aoti.store.remote import Remote
from hatch_aoti.worker.helpers import Helpers
from hatch_aoti.worker.split import shares

FAKES = [sys.executable, str(Path(__file__).with_name("fakes.py"))]


@pytest.fixture(autouse=True)
def _fake_script_is_each_tests_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HATCH_AOTI_FAKE`` tells the fakes what to do; it is gone after each test."""
    monkeypatch.delenv("HATCH_AOTI_FAKE", raising=False)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def gone_within(pids: list[int], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(
    ("names", "jobs", "expected"),
    [
        (["a"], 4, [["a"]]),
        (["a", "b", "c"], 1, [["a", "b", "c"]]),
        (["a", "b", "c"], 2, [["a", "c"], ["b"]]),
        (["a", "b", "c"], 8, [["a"], ["b"], ["c"]]),
        ([], 2, [[]]),
    ],
)
def test_misses_are_shared_within_the_job_limit(names: list[str], jobs: int, expected: list[list[str]]) -> None:
    assert shares(names, jobs) == expected


def run_helpers(tmp_path: Path, groups: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Start one fake helper per group of ``model=behaviour`` pairs; collect the outcomes."""
    script = {m: b for group in groups.values() for m, b in (p.split("=") for p in group.split())}
    monkeypatch.setenv("HATCH_AOTI_FAKE", json.dumps({"script": script}))
    helpers = Helpers(tmp_path, HelperJob([], "", [], str(tmp_path), None), argv=[*FAKES, "helper"])
    helpers.start(
        [
            [Task(m.split("=")[0], "aoti", "p", str(tmp_path / "out" / m.split("=")[0]), {}, []) for m in group.split()]
            for group in groups.values()
        ]
    )
    return {o.model: o for o in helpers.outcomes()}


def test_a_helper_that_dies_fails_only_its_unreported_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = run_helpers(tmp_path, {"h1": "a=ok b=die c=ok", "h2": "d=ok e=fail"}, monkeypatch)
    assert outcomes["a"].error is None and outcomes["a"].files == {"file": "x.so"}
    for model in ("b", "c"):
        assert outcomes[model].error.startswith("the compile helper 1 compiling b, c was killed by signal 9")
    assert outcomes["d"].error is None, "the healthy helper is not blamed"
    assert outcomes["e"].error == "AOTInductor failed: RuntimeError: boom"


def test_helpers_are_read_while_the_coordinator_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big model's event (its weights index) is larger than a pipe holds: its helper must be able to
    write it, and end, before the coordinator asks for outcomes (it compiles its own share first)."""
    import time

    monkeypatch.setenv("HATCH_AOTI_FAKE", json.dumps({"script": {"big": "big"}}))
    helpers = Helpers(tmp_path, HelperJob([], "", [], str(tmp_path), None), argv=[*FAKES, "helper"])
    helpers.start([[Task("big", "aoti", "p", str(tmp_path / "out" / "big"), {}, [])]])
    try:
        (child,) = [c for c, _ in helpers._children.values()]
        deadline = time.monotonic() + 60
        while child.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.proc.poll() == 0, "the helper is blocked writing its event"
        (outcome,) = helpers.outcomes()
    finally:
        helpers.end()
    assert outcome.error is None and len(outcome.files["index"]) == 256 * 1024


def coordination(tmp_path: Path, events: list[dict], end: str = "exit") -> Coordination:
    settings = parse_settings(
        {"models": {n: {"factory": "a:b", "inputs": []} for n in ("a", "b")}}, machine="x86_64", flags=set()
    )
    lines: list[str] = []
    os.environ["HATCH_AOTI_FAKE"] = json.dumps({"events": events, "end": end})
    job = protocol.Job(list(settings.models), str(tmp_path), "compiled", "pkg", [], str(tmp_path), None, None, None, 1)
    return Coordination(
        job, tmp_path, settings, Reporter(lines.append, lines.append, lines.append), argv=[*FAKES, "coordinator"]
    )


def test_a_long_stage_says_it_is_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hatch_aoti.pipeline import core

    monkeypatch.setattr(core, "HEARTBEAT", 0.2)
    events = [
        {"event": "stage", "model": "a", "stage": "compile"},
        {"event": "done", "torch": "2", "built": [], "failed": []},
    ]
    run = coordination(tmp_path, events)
    os.environ["HATCH_AOTI_FAKE"] = json.dumps({"events": events, "sleep": 1.5})
    lines: list[str] = []
    run.report = Reporter(lines.append, lines.append, lines.append)
    with contextlib.suppress(BuildFailed):
        run.run()
    alive = [line for line in lines if line.startswith("aoti: still compiling model 'a': ")]
    assert 2 <= len(alive) <= 8 and alive[-1].endswith("s so far"), lines


def test_a_dead_coordinator_is_named_with_what_it_was_doing(tmp_path: Path) -> None:
    events = [{"event": "stage", "model": "a", "stage": "check"}, {"event": "stage", "model": "b", "stage": "compile"}]
    with pytest.raises(BuildFailed) as info:
        coordination(tmp_path, events, end="die").run()
    assert str(info.value).startswith("the build coordinator was killed by signal 9 while compiling model 'b'")


def test_problems_and_failures_are_reported_together(tmp_path: Path) -> None:
    problems = [["tool.x.models.a.factory", "cannot import"], ["tool.x.models.b.inputs", "bad"]]
    with pytest.raises(ConfigError) as info:
        coordination(tmp_path, [{"event": "problems", "problems": problems}]).run()
    assert info.value.problems == [tuple(p) for p in problems]
    failed = [
        {"event": "failed", "model": "a", "stage": "verify", "message": "differs"},
        {"event": "failed", "model": "b", "stage": "compile", "message": "gcc"},
        {"event": "done", "torch": "2.13.0", "built": [], "failed": ["a", "b"]},
    ]
    with pytest.raises(BuildFailed) as info:
        coordination(tmp_path, failed).run()
    text = str(info.value)
    assert text.startswith("2 models failed:")
    assert "model 'a' (tool.hatch.build.targets.wheel.hooks.aoti.models.a) failed at verify: differs" in text
    assert "failed at compile: gcc" in text


def test_a_coordinator_that_dies_after_a_failure_is_reported_with_it(tmp_path: Path) -> None:
    events = [
        {"event": "built", "model": "a", "seconds": 1.0, "check": "ok"},
        {"event": "failed", "model": "b", "stage": "verify", "message": "differs"},
        {"event": "stage", "model": "c", "stage": "verify"},
    ]
    with pytest.raises(BuildFailed) as info:
        coordination(tmp_path, events, end="die").run()
    text = str(info.value)
    assert text.startswith("the build did not finish; 1 model was built:")  # no cache in this job
    assert "model 'b'" in text and "failed at verify: differs" in text
    assert "the build coordinator was killed by signal 9 while verifying model 'c'" in text


def test_a_finished_coordinator_is_a_success(tmp_path: Path) -> None:
    run = coordination(
        tmp_path,
        [
            {"event": "cached", "model": "a", "seconds": 0.1, "check": "ok"},
            {"event": "done", "torch": "2.13.0", "built": ["a"], "failed": []},
        ],
    )
    run.run()
    assert run.done


def test_the_output_says_where_the_build_is(tmp_path: Path) -> None:
    """Each model's lines carry its place among the build's models; a stage is said once per model (a tuned
    model's candidates enter each again)."""
    events = [
        {"event": "stage", "model": "a", "stage": "check"},
        {"event": "stage", "model": "b", "stage": "check"},
        {"event": "stage", "model": "a", "stage": "export"},
        {"event": "cached", "model": "a", "seconds": 0.41, "check": "ok", "tier": "local"},
        {"event": "stage", "model": "b", "stage": "compile"},
        {"event": "info", "message": "b: candidate x: 1.00 ms per call, verified"},
        {"event": "stage", "model": "b", "stage": "verify"},
        {"event": "stage", "model": "b", "stage": "compile"},
        {"event": "stage", "model": "b", "stage": "tune"},
        {"event": "stage", "model": "b", "stage": "store"},
        {"event": "built", "model": "b", "seconds": 12.34, "check": "not verified (verify = false)"},
        {"event": "done", "torch": "2.13.0", "built": ["a", "b"], "failed": []},
    ]
    run = coordination(tmp_path, events)
    lines: list[str] = []
    run.report = Reporter(lines.append, lines.append, lines.append)
    run.run()
    assert lines == [
        "aoti: [1/2] a: checking",
        "aoti: [2/2] b: checking",
        "aoti: [1/2] a: exporting",
        "aoti: [1/2] a: from cache in 0.4s, ok",
        "aoti: [2/2] b: compiling",
        "aoti: b: candidate x: 1.00 ms per call, verified",
        "aoti: [2/2] b: verifying against eager",
        "aoti: [2/2] b: timing its candidates",
        "aoti: [2/2] b: storing in the cache",
        "aoti: [2/2] b: compiled in 12.3s, not verified (verify = false)",
    ]
    assert run.progress.summary(41.23) == "aoti: 2 models in 41.2s (1 from the cache, 1 compiled)"


def test_the_last_line_counts_what_came_from_the_cache() -> None:
    from hatch_aoti.pipeline.progress import Progress

    progress = Progress(["a", "b", "c"])
    assert progress.summary(0.04) == "aoti: 3 models in 0.0s"
    progress.came("a", "local")
    progress.came("b", "remote")
    progress.came("c", None)
    assert progress.summary(7.26) == "aoti: 3 models in 7.3s (1 from the cache, 1 from the remote cache, 1 compiled)"
    progress.failed("c")
    assert progress.summary(1.0) == "aoti: 3 models in 1.0s (1 from the cache, 1 from the remote cache)"
    one = Progress(["mlp"])
    one.came("mlp", None)
    assert one.summary(12.0) == "aoti: 1 model in 12.0s (1 compiled)"
    assert one.at("mlp") == "[1/1] mlp" and one.entered("mlp", "compile") == "aoti: [1/1] mlp: compiling"
    assert one.entered("mlp", "compile") is None, "said once"


def test_a_child_ends_with_everything_it_started_when_its_parent_goes(tmp_path: Path) -> None:
    """End of file on stdin (the parent exiting, or killed) ends the child's whole process group."""
    child = Child.start("sleeper", [*FAKES, "sleeper"], cwd=tmp_path, log=tmp_path / "sleeper.log")
    event = next(event for _, event in watch([child]) if event is not None)
    assert isinstance(event, protocol.Info)
    pids = json.loads(event.message)
    assert alive(pids["child"]) and alive(pids["grandchild"])
    child.proc.stdin.close()  # what the kernel does when the parent dies
    assert gone_within([pids["child"], pids["grandchild"]]), "the compiler stand-in outlived its parent"
    child.end()


def test_jobs_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from hatch_aoti.pipeline.core import jobs_from_env

    monkeypatch.setenv("HATCH_AOTI_JOBS", "3")
    assert jobs_from_env() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("HATCH_AOTI_JOBS", bad)
        with pytest.raises(BuildFailed, match="HATCH_AOTI_JOBS must be a whole number >= 1"):
            jobs_from_env()
    monkeypatch.delenv("HATCH_AOTI_JOBS")
    assert jobs_from_env() == len(os.sched_getaffinity(0))


def test_every_message_round_trips_through_the_one_codec(tmp_path: Path) -> None:
    from hatch_aoti.pipeline.protocol import EVENTS, decode, encode, read_job, write_job

    samples = [
        protocol.Stage("a", "export"),
        protocol.Cached("a", 0.5, "ok"),
        protocol.Built("a", 1.5, "ok"),
        protocol.Compiled("a", 1.0, {"file": "x.so", "sha256": "0" * 64}),
        protocol.Failed("a", "verify", "differs"),
        protocol.Problems([("tool.hatch-aoti.models.a", "bad")]),
        protocol.Notice("cache unreadable"),
        protocol.Info("2 models"),
        protocol.Done("2.13.0", ["a"], []),
    ]
    assert {type(e) for e in samples} == set(EVENTS.values()), "every kind of event is tried"
    for event in samples:
        assert decode(encode(event)) == event
    for bad in ('{"event": "compiled!"}', "[1]", '{"model": "a"}'):
        with pytest.raises(ValueError, match="not a build event"):
            decode(bad)
    settings = parse_settings(
        {"models": {"m": {"factory": "a:b", "inputs": [{"shape": [2]}]}}}, machine="x86_64", flags=set()
    )
    job = protocol.Job(
        list(settings.models),
        "stage",
        "compiled",
        "pkg",
        ["src"],
        "/p",
        None,
        None,
        Remote("s3://b/p", "read-only", 5.0),
        2,
    )
    write_job(job, tmp_path / "job.json")
    assert read_job(protocol.Job, tmp_path / "job.json") == job
    helper = HelperJob([Task("m", "aoti", "p.pt2", "out", {"a": 1}, ["pkg.models"])], "work", [], "/p", "/cache")
    write_job(helper, tmp_path / "helper.json")
    assert read_job(HelperJob, tmp_path / "helper.json") == helper


def test_the_manifest_is_checked_when_written_and_read(tmp_path: Path) -> None:
    from hatch_aoti.loader.schema import Manifest
    from hatch_aoti.pipeline import manifest

    cpu = {"arch": "x86_64", "target": "x86-64-v3", "features": []}
    entry = {"call": [{"dtype": "float32", "device": "cpu", "shape": [2]}], "cpu": cpu, "device": "cpu", "file": "m.so"}
    good: Manifest = {
        "format": 2,
        "hatch_aoti": "0.2.0",
        "torch": "2.13.0",
        "package": "p",
        "loader": "compiled",
        "models": {"m": entry},
    }  # type: ignore[dict-item]
    manifest.write(tmp_path, good)
    assert manifest.read(tmp_path) == good
    with pytest.raises(ValueError, match="the manifest model 'm': `device` is missing"):
        manifest.write(tmp_path, {**good, "models": {"m": {k: v for k, v in entry.items() if k != "device"}}})  # type: ignore[typeddict-item]
    assert manifest.read(tmp_path) == good, "a refused manifest writes nothing"


def test_a_process_the_factory_started_holding_the_pipe_does_not_hang_the_build(tmp_path: Path) -> None:
    """After ``Done`` the coordinator's exit counts, not its pipe's end; what is left of its group is killed."""
    import threading

    done = {"event": "done", "torch": "2.13.0", "built": [], "failed": []}
    run = coordination(tmp_path, [done])
    os.environ["HATCH_AOTI_FAKE"] = json.dumps({"events": [done], "end": "linger", "pidfile": str(tmp_path / "pid")})
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    thread.join(30)
    pid = int((tmp_path / "pid").read_text()) if (tmp_path / "pid").exists() else None
    try:
        assert not thread.is_alive(), "the build waited for the pipe of a process its coordinator left"
        assert run.done and pid is not None and gone_within([pid]), "the process left behind was killed"
    finally:
        if pid is not None and alive(pid):
            os.kill(pid, 9)


def test_an_internal_error_ends_the_coordinator_cleanly_with_one_message(tmp_path: Path) -> None:
    """An unexpected exception in a build process: its traceback in the log, an exit (never an abort at the
    interpreter's shutdown, which the thread reading stdin caused), and one message with the exception."""
    script = tmp_path / "raiser.py"
    script.write_text(
        "from hatch_aoti.pipeline import protocol\n"
        "from hatch_aoti.pipeline.children import child_main\n"
        "def run(job, parent):\n"
        "    parent.emit(protocol.Stage('a', 'export'))\n"
        "    raise AttributeError(\"'str' object has no attribute 'dtype'\")\n"
        "child_main(run, protocol.Job)\n"
    )
    run = coordination(tmp_path, [])
    run.argv = [sys.executable, str(script)]
    with pytest.raises(BuildFailed) as info:
        run.run()
    text = str(info.value)
    assert text.startswith(
        "internal error of hatch-aoti while exporting model 'a': AttributeError: 'str' object has no attribute 'dtype'"
    ), text
    assert "Traceback (most recent call last)" in (tmp_path / "coordinator.log").read_text()
