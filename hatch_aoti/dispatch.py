"""Run the build workers and gather what they made into one staged package.

Models are spread over up to ``HATCH_AOTI_JOBS`` (default: the machine's cores) worker
processes. Each worker first checks its models and reports; only when every model
checked out does any worker start compiling, so a bad factory in one model still fails
the build before any compile, with all problems listed together.
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
    pending: bytes = b""
    checked: list[tuple[str, str]] | None = None
    done: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    closed: bool = False

    @property
    def log(self) -> Path:
        return self.stage / "worker.log"


@dataclass
class Dispatch:
    models: list[ModelSpec]
    stage: Path
    loader: str
    sys_path: list[str]
    cwd: str
    cache_root: Path | None
    report: Callable[[str], None]
    jobs: int = field(default_factory=lambda: _default_jobs())
    _compile_seconds: dict[str, float] = field(default_factory=dict, init=False)

    def run(self) -> str:
        """Build every model into ``stage/package``; returns the build torch version."""
        workers = self._start()
        try:
            self._pump(workers)
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.kill()
                w.proc.wait()
                if w.proc.stdin:
                    with contextlib.suppress(OSError):  # a dead worker's pipe
                        w.proc.stdin.close()
        self._raise_for(workers)
        return self._merge(workers)

    # -- processes ---------------------------------------------------------------------

    def _start(self) -> list[_Worker]:
        count = max(1, min(self.jobs, len(self.models)))
        groups: list[list[ModelSpec]] = [self.models[i::count] for i in range(count)]
        workers = []
        for index, group in enumerate(groups):
            stage = self.stage / f"w{index}"
            stage.mkdir(parents=True)
            job = {
                "models": [m.to_json() for m in group],
                "stage": str(stage),
                "loader": self.loader,
                "sys_path": self.sys_path,
                "cache": str(self.cache_root) if self.cache_root else None,
            }
            (stage / "job.json").write_text(json.dumps(job), encoding="utf-8")
            read_fd, write_fd = os.pipe()
            env = {**os.environ, "HATCH_AOTI_EVENT_FD": str(write_fd), "PYTHONUNBUFFERED": "1"}
            with (stage / "worker.log").open("wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "hatch_aoti.worker", str(stage / "job.json")],
                    cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                    pass_fds=(write_fd,),
                )  # fmt: skip
            os.close(write_fd)
            workers.append(_Worker(index, group, stage, proc, read_fd))
        return workers

    def _pump(self, workers: list[_Worker]) -> None:
        selector = selectors.DefaultSelector()
        for w in workers:
            selector.register(w.events, selectors.EVENT_READ, w)
        released = False
        try:
            while selector.get_map():
                for key, _ in selector.select():
                    w: _Worker = key.data
                    chunk = os.read(w.events, 65536)
                    if not chunk:
                        selector.unregister(w.events)
                        w.closed = True
                        continue
                    *lines, w.pending = (w.pending + chunk).split(b"\n")
                    for line in lines:
                        self._on_event(w, json.loads(line))
                    if w.error is not None:
                        return  # one model failed: stop the others (killed by run())
                if not released and all(x.checked is not None or x.closed for x in workers):
                    released = True
                    go = all(x.checked == [] for x in workers)
                    for x in workers:
                        self._send(x, "go" if go else "stop")
                    if not go:
                        return
        finally:
            selector.close()
            for w in workers:
                os.close(w.events)

    @staticmethod
    def _send(worker: _Worker, word: str) -> None:
        try:
            assert worker.proc.stdin is not None
            worker.proc.stdin.write(f"{word}\n".encode())
            worker.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def _on_event(self, worker: _Worker, event: dict[str, Any]) -> None:
        kind = event.pop("event")
        name = event.get("model")
        if kind == "checked":
            worker.checked = [tuple(p) for p in event["problems"]]
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
