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
import time
from pathlib import Path

from common import HEADER, build_command, child, only_wheel, run_child, sampled, unpack, write_package

PYPROJECT = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.big]
factory = "bigpkg.models:build"
inputs = [{{ shape = ["batch", {n}] }}]
dynamic = {{ batch = {{ min = 1, max = 8 }} }}
{extra}
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
        [sys.executable, child("big_stages"), str(stage / "job.json"), str(events)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as proc:
        proc.wait()  # stdin stays open until it is done: it ends itself when its pipe closes
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    # each row: the event, its stage, RSS at the event, peak since the previous event
    share: dict[str, int] = {}
    started = None
    for event, stage_name, now, peak in rows:
        if started is not None:
            share[started[0]] = max(share.get(started[0], 0), peak - started[1])
        started = (stage_name, now) if event == "stage" else None
    pt2 = work / "big.pt2"
    save = (
        "import sys; sys.path.insert(0, sys.argv[1]); from bigpkg import compiled; "
        "compiled.save_pt2('big', sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", save, str(site), str(pt2)], check=True, capture_output=True)
    staging = run_child("big_unpack", pt2, work / "unpacked")
    return {
        "key (export stage)": share.get("export", 0),
        "verification": share.get("verify", 0),
        "cache copy": share.get("store", 0),
        "staging": int(staging.split()[-1]),
    }


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
        write_package(project, "bigpkg", "big_models.py", N=args.n)
        (project / "pyproject.toml").write_text(HEADER.format(name="bigpkg") + PYPROJECT.format(n=args.n, extra=extra))
        env = {**os.environ, "HATCH_AOTI_CACHE_DIR": str(work / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(work / "ind")}
        wall, peak_total, peak_one, output, *_ = sampled(build_command(project, work / "dist"), env, project)
        wheel = only_wheel(work / "dist")
        cache_size = sum(p.stat().st_size for p in (work / "cache" / "v2" / "entries").rglob("*") if p.is_file())
        print(f"weights {weights / gb:.2f} GiB")
        print(
            f"build: {wall:.1f} s; peak RSS, all processes {peak_total / gb:.2f} GiB "
            f"({peak_total / weights:.2f}x the weights), largest process {peak_one / gb:.2f} GiB "
            f"({peak_one / weights:.2f}x)"
        )
        print("  " + "\n  ".join(line for line in output.splitlines() if line.startswith("aoti:")))
        print(f"wheel {wheel.stat().st_size / gb:.2f} GiB, cache entry {cache_size / gb:.2f} GiB")
        site = unpack(wheel, work / "site")
        blob = next(site.rglob("weights.bin"))
        load = [sys.executable, child("big_load"), str(site), str(args.n)]
        runs = []
        for _ in range(args.pairs):
            torch_only = run_child("big_import_torch").split()
            out = subprocess.run(load, capture_output=True, text=True, check=True).stdout
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
        holders = [subprocess.Popen([*load, "--hold", "6"], stdout=subprocess.PIPE, text=True) for _ in range(2)]
        lines = [h.communicate()[0].splitlines() for h in holders]
        for i, held in enumerate(lines):
            pss, rss = (int(x) for x in held[1].split()[1::2])
            print(
                f"  process {i + 1} of 2 at once: RSS {rss / gb:.2f} GiB, PSS {pss / gb:.2f} GiB "
                "(PSS divides shared pages between the processes that map them)"
            )


if __name__ == "__main__":
    main()
