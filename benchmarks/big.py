"""A model with GB of weights: build memory, wheel and cache size, load memory and time, sharing.

The model is 4 x Linear(N, N) (N = 8192: 1.07 GB of float32 weights), batch 1 to 8. It is
built with `python -m build --no-isolation` while the RSS of the build's whole process
tree is sampled; then the wheel is unpacked and loaded in fresh processes, next to
`import torch` and to reading the weight bytes from the page cache. Run with the test
venv: `.venv-test/bin/python benchmarks/big.py` (needs about 6 GB of disk and memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zipfile
from pathlib import Path

MODELS = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear({n}, {n}) for _ in range(4)]).eval()
"""
PYPROJECT = """
[build-system]
requires = ["hatchling", "hatch-aoti", "torch==2.13.*"]
build-backend = "hatchling.build"

[project]
name = "bigpkg"
version = "1.0"
dependencies = ["torch==2.13.*"]

[tool.hatch.build.targets.wheel.hooks.aoti.models.big]
factory = "bigpkg.models:build"
inputs = [{{ shape = ["batch", {n}] }}]
dynamic = {{ batch = {{ min = 1, max = 8 }} }}
{extra}
"""
LOAD = """
import sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
sys.path.insert(0, {site!r})
from bigpkg import compiled
y = compiled.load("big")(torch.randn(1, {n}))
t2 = time.perf_counter()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
maps = open("/proc/self/maps").read()
print(t1 - t0, t2 - t1, int(status["VmHWM"].split()[0]) * 1024, int(status["RssAnon"].split()[0]) * 1024,
      int(status["RssFile"].split()[0]) * 1024, "weights.bin" in maps)
if "--hold" in sys.argv:
    time.sleep(3)  # until the other process has loaded too
    pss = dict(line.split(":", 1) for line in open("/proc/self/smaps_rollup").read().splitlines()[1:])
    print("pss", int(pss["Pss"].split()[0]) * 1024, "rss", int(status["VmRSS"].split()[0]) * 1024, flush=True)
    time.sleep(float(sys.argv[-1]))
"""


STAGES = """
import json, sys, threading, time
from hatch_aoti.pipeline import children
from hatch_aoti.worker import coordinator
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
log = open(sys.argv[2], "w")
from hatch_aoti.pipeline import protocol
emit = children.Parent.emit
def logged(self, event):
    kind = type(event).__name__.lower()
    log.write(json.dumps([kind, getattr(event, "stage", None), rss(), peak[0]]) + "\\n"); log.flush()
    peak[0] = rss()
    emit(self, event)
children.Parent.emit = logged
sys.argv = sys.argv[:2]
children.child_main(coordinator.run, protocol.Job)
"""
UNPACK = """
import sys, threading, time
from pathlib import Path
import torch
from hatch_aoti.backends.pt2 import unpack_pt2
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
peak, start = [0], rss()
def sample():
    while True:
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
unpack_pt2(Path(sys.argv[1]), Path(sys.argv[2]))
print(peak[0] - start)
"""


def own_share(project: Path, site: Path, work: Path, n: int) -> dict[str, int]:
    """Peak RSS that hatch-aoti's own steps add in the coordinator: the key (a pass over the
    weights), verification and the cache copy, read off its stage events; and staging (the
    weights laid out for mapping), measured alone on the package torch's loader reads."""
    import json

    from hatch_aoti.frontends.hatch import hook_settings
    from hatch_aoti.pipeline import protocol

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    table = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    settings = hook_settings(table["hooks"]["aoti"])
    stage = work / "stage"
    stage.mkdir()
    job = protocol.Job(
        models=list(settings.models),
        stage=str(stage),
        loader="compiled",
        package="bigpkg",
        sys_path=[str(project)],
        cwd=str(project),
        cache=str(work / "cache2"),
        cache_max_size=2**40,
        remote=None,
        jobs=1,
    )
    protocol.write_job(job, stage / "job.json")
    events = work / "events.jsonl"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(stage / "inductor")}
    with subprocess.Popen(
        [sys.executable, "-c", STAGES, str(stage / "job.json"), str(events)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as proc:
        proc.wait()  # stdin stays open until it is done: it ends itself when its pipe closes
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    # each row: the event, its stage, RSS at the event, peak since the previous event
    share, started = {}, None
    for event, stage_name, now, peak in rows:
        if started is not None:
            share[started[0]] = max(share.get(started[0], 0), peak - started[1])
        started = (stage_name, now) if event == "stage" else None
    pt2 = work / "big.pt2"
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(site)!r}); from bigpkg import compiled;"
            f"compiled.save_pt2('big', {str(pt2)!r})",
        ],
        check=True,
        capture_output=True,
    )
    staging = subprocess.run(
        [sys.executable, "-c", UNPACK, str(pt2), str(work / "unpacked")], check=True, capture_output=True, text=True
    ).stdout
    return {
        "key (export stage)": share.get("export", 0),
        "verification": share.get("verify", 0),
        "cache copy": share.get("store", 0),
        "staging": int(staging.split()[-1]),
    }


def tree_rss(root: int) -> dict[int, int]:
    """RSS in bytes of ``root`` and all its descendants."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
            rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    family, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in family:
                family.add(pid)
                frontier.append(pid)
    return {pid: rss.get(pid, 0) for pid in family}


def sampled(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS of the whole tree, peak RSS of its largest process, output)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_total = peak_one = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_total, peak_one
        while not done.is_set():
            sizes = tree_rss(proc.pid)
            peak_total = max(peak_total, sum(sizes.values()))
            peak_one = max(peak_one, max(sizes.values(), default=0))
            time.sleep(0.02)

    start = time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(output)
    return wall, peak_total, peak_one, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument(
        "--freezing", choices=["default", "on", "off"], default="default", help="the model's `freezing` setting"
    )
    args = parser.parse_args()
    extra = (
        ""
        if args.freezing == "default"
        else f"inductor-configs = {{ freezing = {str(args.freezing == 'on').lower()} }}"
    )
    gb = 2**30
    weights = 4 * (args.n * args.n + args.n) * 4
    with tempfile.TemporaryDirectory(dir=os.environ.get("BIG_TMP")) as tmp:
        work = Path(tmp)
        project = work / "proj"
        (project / "bigpkg").mkdir(parents=True)
        (project / "bigpkg" / "__init__.py").write_text("")
        (project / "bigpkg" / "models.py").write_text(MODELS.format(n=args.n))
        (project / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT.format(n=args.n, extra=extra)))
        env = {**os.environ, "HATCH_AOTI_CACHE_DIR": str(work / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(work / "ind")}
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(work / "dist"), str(project)]
        wall, peak_total, peak_one, output = sampled(cmd, env, project)
        (wheel,) = (work / "dist").glob("*.whl")
        cache_size = sum(p.stat().st_size for p in (work / "cache" / "v2" / "entries").rglob("*") if p.is_file())
        print(f"weights {weights / gb:.2f} GiB")
        print(
            f"build: {wall:.1f} s; peak RSS, all processes {peak_total / gb:.2f} GiB "
            f"({peak_total / weights:.2f}x the weights), largest process {peak_one / gb:.2f} GiB "
            f"({peak_one / weights:.2f}x)"
        )
        print("  " + "\n  ".join(line for line in output.splitlines() if line.startswith("aoti:")))
        print(f"wheel {wheel.stat().st_size / gb:.2f} GiB, cache entry {cache_size / gb:.2f} GiB")
        site = work / "site"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
        blob = next(site.rglob("weights.bin"))
        code = LOAD.format(site=str(site), n=args.n)
        runs = []
        for _ in range(args.pairs):
            torch_only = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import time; t = time.perf_counter(); import torch;"
                    "print(time.perf_counter() - t, int(open('/proc/self/status').read()"
                    ".split('VmHWM:')[1].split()[0]) * 1024)",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            start = time.perf_counter()
            with blob.open("rb") as f:
                buffer = bytearray(1 << 24)
                while f.readinto(buffer):
                    pass
            read = time.perf_counter() - start
            runs.append(
                (
                    float(torch_only[0]),
                    *map(float, out.split()[:2]),
                    *map(int, out.split()[2:5]),
                    out.split()[5] == "True",
                    read,
                    int(torch_only[1]),
                )
            )
        torch_s = statistics.median(r[0] for r in runs)
        load_s = statistics.median(r[2] for r in runs)
        read_s = statistics.median(r[7] for r in runs)
        hwm, anon, file = (statistics.median(r[i] for r in runs) for i in (3, 4, 5))
        print(
            f"load (median of {args.pairs}): import torch {torch_s:.2f} s; compiled.load + first call (batch 1) "
            f"{load_s:.2f} s; reading the weight bytes from the page cache {read_s:.2f} s"
        )
        print(f"  load + first call <= import torch + 1.2 x read: {load_s:.2f} <= {torch_s + 1.2 * read_s:.2f} s")
        print(f"  whole process: {torch_s + load_s:.2f} s vs import torch + 1.2 x read {torch_s + 1.2 * read_s:.2f} s")
        torch_rss = statistics.median(r[8] for r in runs)
        print(
            f"  peak RSS {hwm / gb:.2f} GiB = {hwm / weights:.2f}x the weights (of which mapped file "
            f"{file / gb:.2f} GiB, anonymous {anon / gb:.2f} GiB); weights file mapped: "
            f"{all(r[6] for r in runs)}"
        )
        print(
            f"  above `import torch` alone ({torch_rss / gb:.2f} GiB): {(hwm - torch_rss) / gb:.2f} GiB = "
            f"{(hwm - torch_rss) / weights:.2f}x the weights"
        )
        for step, size in own_share(project, site, work, args.n).items():
            print(f"  hatch-aoti's own share, {step}: {size / gb:.3f} GiB = {size / weights:.3f}x the weights")
        holders = [
            subprocess.Popen([sys.executable, "-c", code, "--hold", "6"], stdout=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        lines = [h.stdout.read().splitlines() for h in holders]
        for h in holders:
            h.wait()
        for i, out in enumerate(lines):
            pss, rss = (int(x) for x in out[1].split()[1::2])
            print(
                f"  process {i + 1} of 2 at once: RSS {rss / gb:.2f} GiB, PSS {pss / gb:.2f} GiB "
                "(PSS divides shared pages between the processes that map them)"
            )


if __name__ == "__main__":
    main()
