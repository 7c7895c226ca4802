"""The build's process protocols, with fake processes instead of torch (no compiling)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from hatch_aoti.build.children import Child, watch
from hatch_aoti.build.pipeline import BuildFailed, Coordination, Reporter
from hatch_aoti.settings.config import ConfigError, parse_settings
from hatch_aoti.worker.helpers import Helpers, Task, shares

FAKES = [sys.executable, str(Path(__file__).with_name("fakes.py"))]


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


def run_helpers(tmp_path: Path, groups: dict[str, str]) -> dict[str, object]:
    """Start one fake helper per group of ``model=behaviour`` pairs; collect the outcomes."""
    script = {m: b for group in groups.values() for m, b in (p.split("=") for p in group.split())}
    helpers = Helpers(tmp_path, {"sys_path": [], "cache": None, "cwd": str(tmp_path), "script": script},
                      argv=[*FAKES, "helper"])  # fmt: skip
    helpers.start([[Task(m.split("=")[0], "aoti", "p", str(tmp_path / "out" / m.split("=")[0]), {}, [])
                    for m in group.split()] for group in groups.values()])  # fmt: skip
    return {o.model: o for o in helpers.outcomes()}


def test_a_helper_that_dies_fails_only_its_unreported_models(tmp_path: Path) -> None:
    outcomes = run_helpers(tmp_path, {"h1": "a=ok b=die c=ok", "h2": "d=ok e=fail"})
    assert outcomes["a"].error is None and outcomes["a"].files == {"file": "x.so"}
    for model in ("b", "c"):
        assert outcomes[model].error.startswith("the compile helper 1 compiling b, c was killed by signal 9")
    assert outcomes["d"].error is None, "the healthy helper is not blamed"
    assert outcomes["e"].error == "AOTInductor failed: RuntimeError: boom"


def coordination(tmp_path: Path, events: list[dict], end: str = "exit") -> Coordination:
    settings = parse_settings({"models": {n: {"factory": "a:b", "inputs": []} for n in ("a", "b")}},
                              machine="x86_64", flags=set())  # fmt: skip
    lines: list[str] = []
    job = {"events": events, "end": end, "cwd": str(tmp_path)}
    return Coordination(job, tmp_path, settings, Reporter(lines.append, lines.append, lines.append),
                        argv=[*FAKES, "coordinator"])  # fmt: skip


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
    failed = [{"event": "failed", "model": "a", "stage": "verify", "message": "differs"},
              {"event": "failed", "model": "b", "stage": "compile", "message": "gcc"},
              {"event": "done", "torch": "2.13.0", "built": [], "failed": ["a", "b"]}]  # fmt: skip
    with pytest.raises(BuildFailed) as info:
        coordination(tmp_path, failed).run()
    text = str(info.value)
    assert text.startswith("2 models failed:")
    assert "model 'a' (tool.hatch.build.targets.wheel.hooks.aoti.models.a) failed at verify: differs" in text
    assert "failed at compile: gcc" in text


def test_a_coordinator_that_dies_after_a_failure_is_reported_with_it(tmp_path: Path) -> None:
    events = [{"event": "compiled", "model": "a", "seconds": 1.0, "check": "ok"},
              {"event": "failed", "model": "b", "stage": "verify", "message": "differs"},
              {"event": "stage", "model": "c", "stage": "verify"}]  # fmt: skip
    with pytest.raises(BuildFailed) as info:
        coordination(tmp_path, events, end="die").run()
    text = str(info.value)
    assert text.startswith("the build did not finish; 1 model was built:")  # no cache in this job
    assert "model 'b'" in text and "failed at verify: differs" in text
    assert "the build coordinator was killed by signal 9 while verifying model 'c'" in text


def test_a_finished_coordinator_is_a_success(tmp_path: Path) -> None:
    run = coordination(tmp_path, [{"event": "cached", "model": "a", "seconds": 0.1, "check": "ok"},
                                  {"event": "done", "torch": "2.13.0", "built": ["a"], "failed": []}])  # fmt: skip
    run.run()
    assert run.done


def test_a_child_ends_with_everything_it_started_when_its_parent_goes(tmp_path: Path) -> None:
    """End of file on stdin (the parent exiting, or killed) ends the child's whole process group."""
    (tmp_path / "job.json").write_text(json.dumps({}))
    child = Child.start("sleeper", [*FAKES, "sleeper", str(tmp_path / "job.json")], cwd=tmp_path,
                        log=tmp_path / "sleeper.log")  # fmt: skip
    pids = next(event for _, event in watch([child]) if event is not None)
    assert alive(pids["child"]) and alive(pids["grandchild"])
    child.proc.stdin.close()  # what the kernel does when the parent dies
    assert gone_within([pids["child"], pids["grandchild"]]), "the compiler stand-in outlived its parent"
    child.end()


def test_jobs_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from hatch_aoti.build.pipeline import jobs_from_env

    monkeypatch.setenv("HATCH_AOTI_JOBS", "3")
    assert jobs_from_env() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("HATCH_AOTI_JOBS", bad)
        with pytest.raises(BuildFailed, match="HATCH_AOTI_JOBS must be a whole number >= 1"):
            jobs_from_env()
    monkeypatch.delenv("HATCH_AOTI_JOBS")
    assert jobs_from_env() == len(os.sched_getaffinity(0))
