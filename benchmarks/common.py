"""What the benchmarks share: building a wheel and unpacking it, the child scripts they run, fresh
processes timed, memory read from /proc, the CPU's name and flags and interleaved timing.

Standard library only at import, so that a child script can import it before torch without
changing what it measures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: The scripts the benchmarks run in processes of their own.
CHILDREN = HERE / "children"
#: The models of the projects the benchmarks build, each copied in as ``<package>/models.py``.
PROJECTS = HERE / "projects"


#: The head of the projects the benchmarks build: hatchling, hatch-aoti, and torch 2.13 to build and run.
HEADER = """
[build-system]
requires = ["hatchling", "hatch-aoti", "torch==2.13.*"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0"
dependencies = ["torch==2.13.*"]
"""


def header(name: str, *requires: str) -> str:
    """:data:`HEADER` for the project ``name``, with ``requires`` added to its ``build-system.requires``."""
    torch = '"torch==2.13.*"]'
    return HEADER.format(name=name).replace(torch, "".join(f'"{r}", ' for r in requires) + torch, 1)


def write_package(project: Path, package: str, models: str, **constants: object) -> Path:
    """``project/package`` with ``PROJECTS/models`` as its ``models.py``, each ``NAME = value`` line
    of ``constants`` set to the value given (a model's size, say)."""
    text = (PROJECTS / models).read_text(encoding="utf-8")
    for name, value in constants.items():
        lines = [line for line in text.splitlines() if line.startswith(f"{name} = ")]
        if len(lines) != 1:
            raise ValueError(f"{models} has no one line `{name} = ...`")
        text = text.replace(lines[0], f"{name} = {value!r}")
    (project / package).mkdir(parents=True)
    (project / package / "__init__.py").write_text("", encoding="utf-8")
    (project / package / "models.py").write_text(text, encoding="utf-8")
    return project / package


def build_command(project: Path, out: Path, isolated: bool = False) -> list[str]:
    """``python -m build --wheel`` of ``project`` into ``out``, without isolation unless asked."""
    cmd = [sys.executable, "-m", "build", "--wheel", "-o", str(out), str(project)]
    if not isolated:
        cmd.insert(4, "--no-isolation")
    return cmd


def build_wheel(
    project: Path, out: Path, env: Mapping[str, str] | None = None, failure: str = "the build failed"
) -> tuple[Path, float, str]:
    """The wheel of ``project`` built into ``out`` without isolation by this interpreter, the
    build's seconds and its stderr (hatch-aoti's lines); a failed build ends the benchmark with
    ``failure`` and the end of the build's output."""
    start = time.perf_counter()
    proc = subprocess.run(
        build_command(project, out), capture_output=True, text=True, env=None if env is None else dict(env)
    )
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{failure}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return only_wheel(out), seconds, proc.stderr


def only_wheel(out: Path) -> Path:
    (wheel,) = out.glob("*.whl")
    return wheel


def unpack(wheel: Path, site: Path) -> Path:
    """The wheel's files under ``site``, importable from there as an installed wheel's are."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def child(name: str) -> str:
    """The path of the child script ``name`` (``children/<name>.py``)."""
    return str(CHILDREN / f"{name}.py")


def run_child(name: str, *args: object, env: Mapping[str, str] | None = None, failure: str | None = None) -> str:
    """The stdout of the child script ``name`` run on ``args``; a failure ends the benchmark with
    ``failure`` (or the script's name) and the end of its stderr."""
    proc = subprocess.run(
        [sys.executable, child(name), *map(str, args)],
        capture_output=True,
        text=True,
        env=None if env is None else dict(env),
    )
    if proc.returncode:
        sys.exit(f"{failure or name + ' failed'}:\n{proc.stderr[-4000:]}")
    return proc.stdout


def wall(code: str, env: Mapping[str, str] | None = None) -> float:
    """Seconds of a fresh ``python -c code``, start to exit, its output dropped."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=None if env is None else dict(env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def status(pid: int | str = "self") -> dict[str, int]:
    """The sizes in ``/proc/<pid>/status`` (``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile``...), in bytes."""
    sizes = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields = value.split()
            if len(fields) == 2 and fields[1] == "kB":
                sizes[key] = int(fields[0]) * 1024
    return sizes


def rss() -> int:
    """This process's resident set, in bytes."""
    return status()["VmRSS"]


class PeakRss:
    """This process's highest resident set since it started (or since :meth:`reset`), sampled every 5 ms
    on a thread of its own."""

    def __init__(self) -> None:
        self.peak = rss()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def reset(self) -> None:
        self.peak = rss()


def tree_rss(root: int) -> dict[int, int]:
    """RSS in bytes of ``root`` and all its descendants."""
    parents: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
            sizes[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    family, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in family:
                family.add(pid)
                frontier.append(pid)
    return {pid: sizes.get(pid, 0) for pid in family}


class Sampled(NamedTuple):
    """What :func:`sampled` measured of a command."""

    seconds: float
    total: int
    """The highest sum of the RSS of the command's process tree (sampled every 20 ms)."""
    largest: int
    """The highest RSS of one process of the tree (sampled)."""
    output: str
    maxrss: int
    """The highest RSS of one process of the tree as the kernel counts it: the command's ``ru_maxrss``
    from ``wait4``, its own or its largest waited-for descendant's, which is what GNU time's ``%M``
    reports. It misses no short peak that the sampling would, and counts the file pages a process maps."""
    peaked: str
    """Which process had the largest sampled RSS, by what it runs."""


def sampled(cmd: list[str], env: Mapping[str, str], cwd: Path) -> Sampled:
    """``cmd`` run to its end, its output kept and its memory measured (see :class:`Sampled`)."""
    proc = subprocess.Popen(cmd, env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_total = peak_one = 0
    peaked = ""
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_total, peak_one, peaked
        while not done.is_set():
            sizes = tree_rss(proc.pid)
            peak_total = max(peak_total, sum(sizes.values()))
            pid, size = max(sizes.items(), key=lambda item: item[1], default=(0, 0))
            if size > peak_one:
                peak_one, peaked = size, process_name(pid) or peaked
            time.sleep(0.02)

    start = time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, wait_status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    proc.stdout.close()
    if proc.returncode:
        raise SystemExit(output)
    return Sampled(wall, peak_total, peak_one, output, usage.ru_maxrss * 1024, peaked)


def process_name(pid: int) -> str:
    """What process ``pid`` of a build is: the coordinator, a compile helper, the build backend, the
    front end, or its command's first word."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    line = " ".join(argv)
    for marker, name in (
        ("hatch_aoti.worker.coordinator", "the coordinator"),
        ("hatch_aoti.worker.helpers", "a compile helper"),
        ("_in_process.py", "the build backend"),
        ("-m build", "python -m build"),
    ):
        if marker in line:
            return name
    return Path(argv[0]).name


def cpu_flags() -> set[str]:
    """The CPU's flags, as /proc/cpuinfo gives them (``avx512_bf16``, ``amx_bf16``...); none where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(calls: Mapping[str, Callable[[], object]], threads: int, rounds: int) -> dict[str, float]:
    """Each callable's median time (s) per round, interleaved; the median over the rounds."""
    import statistics

    import torch
    from torch.utils.benchmark import Timer

    times: dict[str, list[float]] = {k: [] for k in calls}
    with torch.inference_mode():
        for _ in range(rounds):
            for key, call in calls.items():
                timer = Timer("call()", globals={"call": call}, num_threads=threads)
                times[key].append(timer.blocked_autorange(min_run_time=1.0).median)
    return {k: statistics.median(v) for k, v in times.items()}
