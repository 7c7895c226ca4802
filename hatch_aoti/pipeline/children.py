"""Child processes of a build: their own process group, events on a pipe (``protocol.py``), and an end with
their parent.

A child reads its stdin until end of file; the parent closes that pipe only when it wants
the child gone, and the kernel closes it when the parent dies. End of file makes the
child kill its whole process group at once, compilers included. Events travel on a
separate pipe, so that whatever user code prints goes to the child's log.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from hatch_aoti.pipeline.protocol import AnyJob, Event, decode, encode, read_job

EVENT_FD = "HATCH_AOTI_EVENT_FD"
#: The exit status of a child that met an unexpected exception (its traceback is in its log).
INTERNAL_ERROR = 70
LOG_TAIL_LINES = 40


@dataclass
class Child:
    """A running child process, seen from its parent."""

    name: str
    proc: subprocess.Popen[bytes]
    events: int
    """Read end of the child's event pipe (a raw fd: events are read as they arrive)."""
    log: Path
    pending: bytes = b""
    closed: bool = False

    @classmethod
    def start(
        cls, name: str, argv: list[str], *, cwd: str | Path, log: Path, env: dict[str, str] | None = None
    ) -> Child:
        read_fd, write_fd = os.pipe()
        child_env = {**(os.environ if env is None else env), EVENT_FD: str(write_fd), "PYTHONUNBUFFERED": "1"}
        try:
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env=child_env,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_fd,),
                    start_new_session=True,
                )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return cls(name, proc, read_fd, log)

    def read(self) -> list[Event]:
        """The events that arrived (call when the fd is readable); marks the child closed at end of file."""
        chunk = os.read(self.events, 65536)
        if not chunk:
            self.closed = True
            return []
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        return [decode(line) for line in lines if line.strip()]

    def kill(self) -> None:
        """Stop the child and everything it started: what is left of its process group, even once the child
        itself has ended (a process that the user's factory started may still hold its pipe). The kernel
        gives no new process the id of a group that still has members, so the group is the child's."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def end(self) -> None:
        """Stop the child and everything it started, if still running; release its pipes."""
        self.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(OSError):
            os.close(self.events)

    def how_it_ended(self) -> str:
        code = self.proc.wait()
        return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "  (no log)"
        return "\n".join(f"  | {line}" for line in lines[-LOG_TAIL_LINES:]) or "  (empty log)"


def watch(children: list[Child]) -> Iterator[tuple[Child, Event | None]]:
    """Events of all children as they arrive; ``(child, None)`` once when a child's pipe closes."""
    with selectors.DefaultSelector() as selector:
        for child in children:
            if not child.closed:
                selector.register(child.events, selectors.EVENT_READ, child)
        while selector.get_map():
            for key, _ in selector.select():
                ready: Child = key.data
                for event in ready.read():
                    yield ready, event
                if ready.closed:
                    selector.unregister(ready.events)
                    yield ready, None


# -- the child's side -----------------------------------------------------------------------


class Parent:
    """This process's link to the parent that started it with :meth:`Child.start`."""

    def __init__(self) -> None:
        fd = os.environ.pop(EVENT_FD, None)
        self._events = os.fdopen(int(fd), "w", buffering=1, encoding="utf-8") if fd else None
        threading.Thread(target=self._listen, name="hatch-aoti-parent", daemon=True).start()

    def emit(self, event: Event) -> None:
        if self._events is not None:
            self._events.write(encode(event) + "\n")

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None

    def _listen(self) -> None:
        for _ in sys.stdin.buffer:  # nothing is sent: end of file is the parent's only word
            pass
        _end_group()


def _end_group() -> NoReturn:
    """The parent is gone or wants us gone: end this process and everything it started."""
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(1)  # not reached


def exit_without_teardown(code: int) -> NoReturn:
    """End a child without finalising the interpreter.

    Tearing down a process that imported torch's export stack takes about half a second
    (module and object teardown), longer than a whole cached model. Nothing is lost by
    skipping it: every result is on disk and every event written by now. Exit handlers
    still run, so torch's compile worker pools and logging shut down as usual.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def child_main(run: Callable[[AnyJob, Parent], int], kind: type[AnyJob]) -> NoReturn:
    """Run ``run(job, parent)`` for the job file named on the command line, then exit."""
    job = read_job(kind, Path(sys.argv[1]))
    parent = Parent()
    try:
        code = run(job, parent)
    except Exception:  # an internal error: its traceback to the log, and an exit the parent reports
        traceback.print_exc()
        code = INTERNAL_ERROR
    parent.close()
    # Never the interpreter's shutdown: a daemon thread (the one reading stdin) would abort it (SIGABRT).
    exit_without_teardown(code)
