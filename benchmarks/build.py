"""Build-time benchmark: cold build, warm rebuild (compile cache hit), hook-less build.

Run with an interpreter that has hatch-aoti, torch and `build` installed (the test venv:
`.venv-test/bin/python benchmarks/build.py`). Every build gets a fresh
TORCHINDUCTOR_CACHE_DIR, so torch's own caches never help; the cold build also gets an
empty hatch-aoti cache. Builds are `python -m build --wheel --no-isolation` (with
`--isolated`, also the isolated builds that install build requirements every time).
Rounds are interleaved and medians printed, with the cores each build kept busy (CPU
time of the build and its processes over wall time). "Floor" is what any rebuild that
exports its models pays at least: the hook-less build plus a process that only imports
torch and its export stack the way the coordinator does.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed_build(project: Path, out: Path, env: dict[str, str], isolated: bool) -> tuple[float, float]:
    """(wall seconds, cores used) of one build."""
    cmd = [sys.executable, "-m", "build", "--wheel", "-o", str(out), str(project)]
    if not isolated:
        cmd.insert(4, "--no-isolation")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu / wall


PRELOAD = "import os; from hatch_aoti.worker.bootstrap import preload_torch; preload_torch(); os._exit(0)"


def timed_preload(env: dict[str, str]) -> float:
    """Wall seconds of a fresh process that imports torch and torch.export, then exits."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", PRELOAD], check=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--isolated", action="store_true", help="also time isolated builds")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        project = work / "sample_project"
        shutil.copytree(REPO / "sample_project", project, ignore=shutil.ignore_patterns("dist", "build"))
        base_env = {k: v for k, v in os.environ.items() if k not in ("HATCH_AOTI_NO_CACHE", "HATCH_BUILD_NO_HOOKS")}
        modes = [False, True] if args.isolated else [False]
        if args.isolated:
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "wh"), str(REPO)], check=True
            )
            base_env["PIP_FIND_LINKS"] = f"{work / 'wh'} {os.environ.get('PIP_FIND_LINKS', '')}".strip()
        results: dict[str, list[float]] = {}
        for round_index in range(args.rounds):
            for isolated in modes:
                tag = "isolated" if isolated else "no-isolation"
                aoti_cache = work / f"aoti-cache-{round_index}-{tag}"

                out = work / "dist"
                for label, extra in (("cold", {}), ("warm", {}), ("hook-less", {"HATCH_BUILD_NO_HOOKS": "true"})):
                    env = {
                        **base_env,
                        "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{round_index}-{tag}-{label}"),
                        "HATCH_AOTI_CACHE_DIR": str(aoti_cache),
                        **extra,
                    }
                    seconds, cores = timed_build(project, out, env, isolated)
                    results.setdefault(f"{tag} {label}", []).append(seconds)
                    results.setdefault(f"{tag} {label} cores", []).append(cores)
                    print(
                        f"round {round_index + 1} {tag:12s} {label:9s} {seconds:6.2f}s  {cores:.2f} cores", flush=True
                    )
                results.setdefault(f"{tag} import", []).append(timed_preload(base_env))
        print()
        for tag in ("isolated" if m else "no-isolation" for m in modes):
            cold = statistics.median(results[f"{tag} cold"])
            warm = statistics.median(results[f"{tag} warm"])
            bare = statistics.median(results[f"{tag} hook-less"])
            imports = statistics.median(results[f"{tag} import"])
            cores = statistics.median(results[f"{tag} cold cores"])
            print(f"{tag}: cold {cold:.2f}s, warm {warm:.2f}s, hook-less {bare:.2f}s (medians of {args.rounds})")
            print(f"  cold build kept {cores:.2f} cores busy")
            print(f"  warm / cold      = {warm / cold:.3f}  (goal <= 0.15)")
            print(f"  warm / hook-less = {warm / bare:.2f}")
            print(
                f"  floor / cold     = {(bare + imports) / cold:.3f}  (hook-less + importing torch and its "
                f"export stack {imports:.2f}s)"
            )


if __name__ == "__main__":
    main()
