"""Compile helpers: processes that compile saved exported programs for the coordinator.

The coordinator keeps one share of the cache misses and hands each other share to a
helper started for it (``python -m hatch_aoti.worker.helpers JOB``). A helper never runs the
project's code beyond importing the factories' modules (custom ops register there): it
loads each program, compiles it, reports it, and exits. A helper that dies fails the
models it had not reported, and only those.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hatch_aoti.pipeline import protocol
from hatch_aoti.pipeline.children import Child, Parent, watch
from hatch_aoti.pipeline.protocol import HelperJob, Task


@dataclass
class Outcome:
    """What became of one task: the artifact's file fields, or why there is none."""

    model: str
    files: dict[str, Any] | None = None
    seconds: float = 0.0
    error: str | None = None
    lasting: bool = False
    """The error would come again on the same inputs (see :class:`protocol.Failed`)."""


class Helpers:
    """The helpers of one build, from their start to the last outcome."""

    def __init__(self, stage: Path, job: HelperJob, argv: list[str] | None = None) -> None:
        """``job`` has what every helper shares (its tasks and scratch directory are each helper's own)."""
        self._stage, self._job = stage, job
        self._argv = argv or [sys.executable, "-m", "hatch_aoti.worker.helpers"]
        self._children: dict[int, tuple[Child, list[str]]] = {}
        self._events: queue.Queue[tuple[Child, protocol.Event | None] | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, groups: list[list[Task]]) -> None:
        import os

        for group in groups:
            index = len(self._children) + 1
            home = self._stage / f"helper-{index}"
            home.mkdir(parents=True)
            protocol.write_job(replace(self._job, tasks=group, work=str(home)), home / "job.json")
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor")}
            child = Child.start(
                f"compile helper {index}",
                [*self._argv, str(home / "job.json")],
                cwd=self._job.cwd,
                log=home / "helper.log",
                env=env,
            )
            self._children[child.events] = (child, [t.model for t in group])
        # Their pipes are read from now on, while this process compiles its own share: an event
        # larger than a pipe holds (a big model's weights index) would otherwise block its helper.
        self._reader = threading.Thread(target=self._read, name="hatch-aoti-helpers", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for item in watch([c for c, _ in self._children.values()]):
                self._events.put(item)
        except BaseException as exc:  # an unreadable event: the models still pending fail with it
            self._error = exc
        finally:
            self._events.put(None)

    def _received(self) -> Iterator[tuple[Child, Any]]:
        if self._reader is None:
            return
        while (item := self._events.get()) is not None:
            yield item

    def outcomes(self) -> Iterator[Outcome]:
        """Each task's outcome as it arrives; a dead helper's unreported tasks fail with its log."""
        pending = {fd: list(models) for fd, (_, models) in self._children.items()}
        try:
            for child, event in self._received():
                if event is None:
                    left = pending.pop(child.events, [])
                    if left:
                        why = (
                            f"the {child.name} compiling {', '.join(left)} {child.how_it_ended()}; "
                            f"last lines of its log:\n{child.log_tail()}"
                        )
                        yield from (Outcome(model, error=why) for model in left)
                    continue
                if isinstance(event, protocol.Compiled):
                    pending[child.events].remove(event.model)
                    yield Outcome(event.model, files=event.files, seconds=event.seconds)
                elif isinstance(event, protocol.Failed):
                    pending[child.events].remove(event.model)
                    yield Outcome(event.model, error=event.message, lasting=event.lasting)
            why = f"the compile helpers' events could not be read ({self._error!r})"
            yield from (Outcome(model, error=why) for left in pending.values() for model in left)
        finally:
            self.end()

    def end(self) -> None:
        for child, _ in self._children.values():
            child.kill()
        if self._reader is not None:  # their pipes close with them: the reader ends before they are released
            self._reader.join(timeout=30)  # a grandchild holding a pipe open cannot keep the build waiting
        for child, _ in self._children.values():
            child.end()


def run(job: HelperJob, parent: Parent) -> int:
    """The helper process: compile each task's program and report it."""
    from hatch_aoti.worker.bootstrap import setup

    setup(job)
    import importlib

    import torch

    from hatch_aoti import backends

    for task in job.tasks:
        start, loaded = time.perf_counter(), False
        try:
            backend = backends.get(task.backend)
            for module in task.modules:
                importlib.import_module(module)
            exported, loaded = torch.export.load(task.program), True
            files = backend.compile(
                backends.Request(task.model, exported, task.inductor_configs, Path(task.out), Path(job.work))
            )
        except Exception as exc:  # only the compile's own failure would come again in the coordinator
            parent.emit(
                protocol.Failed(task.model, "compile", _why(task, exc, Path(job.work)), loaded and lasting(exc))
            )
            continue
        parent.emit(protocol.Compiled(task.model, time.perf_counter() - start, files))
    return 0


def _why(task: Task, exc: Exception, work: Path) -> str:
    from hatch_aoti.store.cache import NoSpace, out_of_space

    if out_of_space(exc):  # the weights twice: Inductor's package, then unpacked
        return str(NoSpace(work, 2 * Path(task.program).stat().st_size))
    return f"the {task.backend} backend failed: {type(exc).__name__}: {exc}"


def lasting(exc: BaseException) -> bool:
    """Whether a compile's exception would come again on the same inputs: not one for want of memory
    or disk, nor a compiler killed by a signal (the kernel's out-of-memory killer, say)."""
    import subprocess

    from hatch_aoti.store.cache import out_of_space

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MemoryError) or out_of_space(seen):
            return False
        if isinstance(seen, subprocess.CalledProcessError) and seen.returncode < 0:
            return False
        seen = seen.__cause__ or seen.__context__
    return "Killed signal" not in str(exc)  # gcc's words for a compiler process killed


if __name__ == "__main__":
    from hatch_aoti.pipeline.children import child_main

    child_main(run, HelperJob)
