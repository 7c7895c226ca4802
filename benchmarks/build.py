"""Build-time benchmark: cold build, warm rebuild (compile cache hit), a build on a machine whose
local cache is empty and whose remote tier is warm, and a hook-less build.

Run with an interpreter that has hatch-aoti, torch, `build` and the test extras installed (the
test venv: `.venv-test/bin/python benchmarks/build.py`). Every build gets a fresh
TORCHINDUCTOR_CACHE_DIR, so torch's own caches never help; the cold build also gets an
empty hatch-aoti cache and an empty remote tier (a new prefix in a bucket of moto's S3
server on loopback, or under `--remote URL`), which it fills; "cold-local" is the same cold
build without a remote tier, so nothing is uploaded. "remote-warm" is the next
machine of a fleet: an empty local cache, the remote tier the cold build filled. Builds are
`python -m build --wheel --no-isolation` (with `--isolated`, also the isolated builds that
install build requirements every time). Rounds are interleaved and medians printed, with the
cores each build kept busy (CPU time of the build and its processes over wall time). "Floor"
is what any rebuild that exports its models pays at least: the hook-less build plus a
process that only imports torch and its export stack the way the coordinator does.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from common import REPO, build_command


def timed_build(project: Path, out: Path, env: dict[str, str], isolated: bool) -> tuple[float, float]:
    """(wall seconds, cores used) of one build."""
    cmd = build_command(project, out, isolated)
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


@contextlib.contextmanager
def remote_store(url: str | None) -> Iterator[tuple[str, dict[str, str]]]:
    """(URL, environment) of the remote tier: ``url`` as given, or a bucket on moto's S3 server on loopback."""
    if url:
        yield url.rstrip("/"), {}
        return
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    try:
        client = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        client.create_bucket(Bucket="bench-cache")
        yield "s3://bench-cache", env
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--isolated", action="store_true", help="also time isolated builds")
    parser.add_argument("--remote", help="remote tier to use (an fsspec URL); default: moto's S3 server on loopback")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, remote_store(args.remote) as (remote_url, remote_env):
        work = Path(tmp)
        project = work / "sample_project"
        shutil.copytree(REPO / "sample_project", project, ignore=shutil.ignore_patterns("dist", "build"))
        skip = ("HATCH_AOTI_NO_CACHE", "HATCH_BUILD_NO_HOOKS", "HATCH_AOTI_REMOTE_CACHE_MODE")
        base_env = {**{k: v for k, v in os.environ.items() if k not in skip}, **remote_env}
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
                fleet = {"HATCH_AOTI_REMOTE_CACHE": f"{remote_url}/{uuid.uuid4().hex}"}
                fresh = {"HATCH_AOTI_CACHE_DIR": str(work / f"aoti-cache-{round_index}-{tag}-fresh"), **fleet}
                builds = (
                    ("cold-local", {"HATCH_AOTI_CACHE_DIR": str(work / f"aoti-cache-{round_index}-{tag}-alone")}),
                    ("cold", fleet),
                    ("warm", fleet),
                    ("remote-warm", fresh),
                    ("hook-less", {"HATCH_BUILD_NO_HOOKS": "true"}),
                )
                for label, extra in builds:
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
                        f"round {round_index + 1} {tag:12s} {label:11s} {seconds:6.2f}s  {cores:.2f} cores", flush=True
                    )
                results.setdefault(f"{tag} import", []).append(timed_preload(base_env))
        print()
        for tag in ("isolated" if m else "no-isolation" for m in modes):
            cold = statistics.median(results[f"{tag} cold"])
            warm = statistics.median(results[f"{tag} warm"])
            remote = statistics.median(results[f"{tag} remote-warm"])
            alone = statistics.median(results[f"{tag} cold-local"])
            bare = statistics.median(results[f"{tag} hook-less"])
            imports = statistics.median(results[f"{tag} import"])
            cores = statistics.median(results[f"{tag} cold cores"])
            print(
                f"{tag}: cold {cold:.2f}s, warm {warm:.2f}s, remote-warm {remote:.2f}s, hook-less {bare:.2f}s "
                f"(medians of {args.rounds}; remote tier {remote_url})"
            )
            print(f"  cold build kept {cores:.2f} cores busy; without a remote tier (nothing uploaded) {alone:.2f}s")
            print(f"  warm / cold      = {warm / cold:.3f}  (goal <= 0.15)")
            paired = statistics.median(r / w for r, w in zip(results[f"{tag} remote-warm"], results[f"{tag} warm"]))
            print(f"  remote-warm / warm = {remote / warm:.3f}; each round's, median {paired:.3f}  (goal <= 1.3)")
            print(f"  remote-warm / cold = {remote / cold:.3f}")
            print(f"  warm / hook-less = {warm / bare:.2f}")
            print(
                f"  floor / cold     = {(bare + imports) / cold:.3f}  (hook-less + importing torch and its "
                f"export stack {imports:.2f}s)"
            )


if __name__ == "__main__":
    main()
