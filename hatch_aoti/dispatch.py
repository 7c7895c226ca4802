"""Run the build workers and gather what they made into one staged package.

Each worker checks its models, reports, and waits: only when every model checked out
does any worker go on, so a bad factory in one model still fails the build before any
compile, with all problems listed together. Then each worker exports its models and
takes what it can from the compile cache; the misses it reports are shared out, up to
``HATCH_AOTI_JOBS`` (default: the machine's cores) workers at once.

How many workers to start is a guess made before anything is exported: if the last
build of this project left every model's entry in the cache, one worker takes all
models (a cached rebuild then imports torch once, not once per core); otherwise the
models are spread over workers from the start, so compiles begin without waiting for a
helper to import torch. A wrong guess only costs time: a worker whose misses outnumber
it hands them to helpers started on the spot.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hatch_aoti.artifacts import ARTIFACT_DIR, MANIFEST, write_loader
from hatch_aoti.cache import CompileCache
from hatch_aoti.config import HOOK_PATH, ConfigError, ModelSpec

LOG_TAIL_LINES = 40
ENV_JOBS = "HATCH_AOTI_JOBS"


class BuildFailed(Exception):
    """A build error whose message is complete; shown without a traceback."""


@dataclass
class _Worker:
    index: int
    models: list[ModelSpec]
    stage: Path
    proc: subprocess.Popen[bytes]
    events: int
    """Read end of the worker's event pipe (raw fd: events are read as they arrive)."""
    helper: bool = False
    """Started for another worker's cache misses, after the initial check."""
    pending: bytes = b""
    checked: list[tuple[str, str]] | None = None
    done: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    closed: bool = False

    @property
    def log(self) -> Path:
        return self.stage / "worker.log"

    @property
    def busy(self) -> bool:
        return not self.closed and self.done is None


@dataclass
class Dispatch:
    models: list[ModelSpec]
    stage: Path
    loader: str
    sys_path: list[str]
    cwd: str
    cache: CompileCache | None
    report: Callable[[str], None]
    project: str = ""
    """Names this project's record of its last build's cache keys (the start-up guess)."""
    jobs: int = field(default_factory=lambda: _default_jobs())
    _workers: list[_Worker] = field(default_factory=list, init=False)
    _selector: selectors.BaseSelector | None = field(default=None, init=False)
    _compile_seconds: dict[str, float] = field(default_factory=dict, init=False)

    def run(self) -> str:
        """Build every model into ``stage/package``; returns the build torch version."""
        self._selector = selectors.DefaultSelector()
        try:
            for group in self._initial_groups():
                self._spawn(group)
            self._pump()
        finally:
            self._selector.close()
            for w in self._workers:
                if w.proc.poll() is None:
                    w.proc.kill()
                w.proc.wait()
                if w.proc.stdin:
                    with contextlib.suppress(OSError):  # a dead worker's pipe
                        w.proc.stdin.close()
                with contextlib.suppress(OSError):
                    os.close(w.events)
        self._raise_for(self._workers)
        torch_version = self._merge(self._workers)
        self._remember_keys()
        return torch_version

    # -- processes ---------------------------------------------------------------------

    def _initial_groups(self) -> list[list[ModelSpec]]:
        if self._all_cached_last_time():
            return [list(self.models)]
        count = max(1, min(self.jobs, len(self.models)))
        return [self.models[i::count] for i in range(count)]

    def _all_cached_last_time(self) -> bool:
        if self.cache is None or not self.project:
            return False
        last = self.cache.recall(self.project)
        return all(m.name in last and self.cache.has(last[m.name]) for m in self.models)

    def _remember_keys(self) -> None:
        if self.cache is None or not self.project:
            return
        keys = {name: key for w in self._workers for name, key in (w.done or {}).get("keys", {}).items()}
        with contextlib.suppress(OSError):  # only a start-up guess: never worth failing a build
            self.cache.remember(self.project, keys)

    def _spawn(self, group: list[ModelSpec], helper: bool = False) -> _Worker:
        assert self._selector is not None
        index = len(self._workers)
        stage = self.stage / f"w{index}"
        stage.mkdir(parents=True)
        job = {
            "models": [m.to_json() for m in group],
            "stage": str(stage),
            "loader": self.loader,
            "sys_path": self.sys_path,
            "cache": str(self.cache.root) if self.cache else None,
        }
        (stage / "job.json").write_text(json.dumps(job), encoding="utf-8")
        read_fd, write_fd = os.pipe()
        env = {**os.environ, "HATCH_AOTI_EVENT_FD": str(write_fd), "PYTHONUNBUFFERED": "1"}
        try:
            with (stage / "worker.log").open("wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "hatch_aoti.worker", str(stage / "job.json")],
                    cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                    pass_fds=(write_fd,),
                )  # fmt: skip
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        worker = _Worker(index, group, stage, proc, read_fd, helper=helper)
        self._workers.append(worker)
        self._selector.register(read_fd, selectors.EVENT_READ, worker)
        return worker

    def _pump(self) -> None:
        assert self._selector is not None
        initial = list(self._workers)
        released = False
        while self._selector.get_map():
            for key, _ in self._selector.select():
                w: _Worker = key.data
                chunk = os.read(w.events, 65536)
                if not chunk:
                    self._selector.unregister(w.events)
                    w.closed = True
                    continue
                *lines, w.pending = (w.pending + chunk).split(b"\n")
                for line in lines:
                    self._on_event(w, json.loads(line))
                if w.error is not None or (w.helper and w.checked):
                    return  # a model failed: stop the others (killed by run())
            if not released and all(x.checked is not None or x.closed for x in initial):
                released = True
                go = all(x.checked == [] for x in initial)
                for x in initial:
                    self._send(x, {"go": go})
                if not go:
                    return

    @staticmethod
    def _send(worker: _Worker, message: dict[str, Any]) -> None:
        try:
            assert worker.proc.stdin is not None
            worker.proc.stdin.write(json.dumps(message).encode() + b"\n")
            worker.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def _share(self, worker: _Worker, misses: list[str]) -> None:
        """Keep one share of ``worker``'s misses with it; start helpers for the rest."""
        groups = share_out(misses, idle=self.jobs - sum(1 for w in self._workers if w.busy))
        if len(groups) > 1:
            self.report(f"aoti: {len(misses)} models missed the cache: compiling them in {len(groups)} workers")
        by_name = {m.name: m for m in self.models}
        handed = {name for group in groups[1:] for name in group}
        worker.models = [m for m in worker.models if m.name not in handed]
        self._send(worker, {"build": groups[0]})
        for group in groups[1:]:
            self._spawn([by_name[name] for name in group], helper=True)

    def _on_event(self, worker: _Worker, event: dict[str, Any]) -> None:
        kind = event.pop("event")
        name = event.get("model")
        if kind == "checked":
            worker.checked = [tuple(p) for p in event["problems"]]
            if worker.helper and not worker.checked:
                self._send(worker, {"go": True})  # its models already checked out elsewhere
        elif kind == "planned":
            if event["misses"]:
                self._share(worker, event["misses"])
        elif kind == "done":
            worker.done = event
        elif kind == "model_error":
            worker.error = event
        elif kind == "model_cached":
            self.report(f"aoti: {name}: from cache in {event['seconds']:.1f}s, {_check(event['verification'])}")
        elif kind == "warning":
            self.report(f"aoti: warning: {event['message']}")
        elif kind == "model_compiled":
            self._compile_seconds[name] = event["seconds"]
        elif kind == "model_verified":
            seconds = self._compile_seconds.get(name, 0.0) + event.get("seconds", 0.0)
            self.report(f"aoti: {name}: compiled in {seconds:.1f}s, {_check(event['verification'])}")

    # -- results -----------------------------------------------------------------------

    def _raise_for(self, workers: list[_Worker]) -> None:
        order = {m.name: i for i, m in enumerate(self.models)}
        problems = [p for w in workers for p in (w.checked or [])]
        if problems:
            def model_of(path: str) -> int:
                rest = path.removeprefix(f"{HOOK_PATH}.models.")
                return order.get(rest.split(".")[0].split("[")[0], len(order))

            raise ConfigError(sorted(problems, key=lambda p: model_of(p[0])))
        for w in workers:
            if w.error is not None:
                err = w.error
                path = f"{HOOK_PATH}.models.{err['model']}"
                raise BuildFailed(f"model {err['model']!r} ({path}) failed at {err['stage']}: {err['message']}")
        for w in workers:
            if w.done is None:
                code = w.proc.returncode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                names = ", ".join(m.name for m in w.models)
                raise BuildFailed(f"the compile worker for {names} {how}; last lines of its log:\n{_tail(w.log)}")

    def _merge(self, workers: list[_Worker]) -> str:
        package = self.stage / "package"
        (package / ARTIFACT_DIR).mkdir(parents=True)
        entries: dict[str, Any] = {}
        manifest: dict[str, Any] = {}
        for w in workers:
            part = json.loads((w.stage / "package" / ARTIFACT_DIR / MANIFEST).read_text(encoding="utf-8"))
            manifest = {k: v for k, v in part.items() if k not in ("models", "format")}
            entries.update(part["models"])
            for name in part["models"]:
                shutil.move(str(w.stage / "package" / ARTIFACT_DIR / name), str(package / ARTIFACT_DIR / name))
        manifest["models"] = {m.name: entries[m.name] for m in self.models}
        write_loader(package, self.loader, manifest)
        return str(manifest["torch"])


def share_out(misses: list[str], idle: int) -> list[list[str]]:
    """Split one worker's cache misses into shares, one per worker; the first stays with it.

    ``idle`` is how many more workers the job limit allows right now. A helper must import
    torch and export its models again before compiling (a couple of seconds), which a
    compile (tens of seconds) repays many times over.
    """
    shares = 1 + max(0, min(idle, len(misses) - 1))
    return [misses[i::shares] for i in range(shares)]


def _default_jobs() -> int:
    raw = os.environ.get(ENV_JOBS, "")
    if raw.strip():
        try:
            return max(1, int(raw))
        except ValueError:
            raise BuildFailed(f"{ENV_JOBS} must be a whole number, not {raw!r}") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def _check(report: dict[str, Any] | None) -> str:
    if not report or report.get("passed") is None:
        return "not verified (verify = false)"
    tried = report.get("tried", [])
    worst = max((t["max_abs_err"] for t in tried), default=0.0)
    return f"verified against eager on {len(tried)} input set(s), max abs err {worst:.2g}"


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "  (no log)"
    return "\n".join(f"  | {line}" for line in lines[-LOG_TAIL_LINES:])
