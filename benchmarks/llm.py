"""A 1.1B-parameter Llama in bfloat16 with external weights: build time and memory, wheel, fetch, error.

The model has TinyLlama's shape (`transformers.LlamaConfig`: hidden 2048, 22 layers, 32 heads,
4 key-value heads, vocabulary 32000; seeded random weights, about 2.2 GB), called on 1 x 32
tokens for the last token's logits. It is built with `weights = "external"` (or, with
`--weights mapped`, in the wheel) by `python -m build --no-isolation`; the build's memory is its
largest process's peak RSS as the kernel counts it (`wait4`'s `ru_maxrss`, GNU time's `%M`), less
that of the same build of a model without weights (torch and its compile stack), over the weights.
The weights file is then served from 127.0.0.1 and fetched by a fresh process with an empty
cache, timed against curl fetching the same file right after, over several rounds (a loopback
fetch's time swings with the disk's writeback), and the logits compared with eager's.
Run with the test venv: `.venv-test/bin/python benchmarks/llm.py` (about 10 GB of disk).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import HEADER, Sampled, build_command, only_wheel, run_child, sampled, unpack, write_package

PYPROJECT = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.llama]
factory = "llmpkg.models:llama"
inputs = [{{ shape = [1, 32], dtype = "int64", high = 32000 }}]
weights = "external"
weights-url = "{url}"
"""
#: The same model with its weights in the wheel, mapped at load.
MAPPED = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.llama]
factory = "llmpkg.models:llama"
inputs = [{ shape = [1, 32], dtype = "int64", high = 32000 }]
"""
#: The same build of a model with next to no weights: what torch and the compile stack cost alone.
FIXED = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.tiny]
factory = "fixedpkg.models:tiny"
inputs = [{ shape = [1, 8], dtype = "bfloat16" }]
"""


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    handler = functools.partial(Quiet, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return httpd, httpd.server_address[1]


def plain_read(url: str, out: Path) -> float:
    """Seconds for curl (else urllib) to fetch ``url`` to a file: the fetch's yardstick."""
    import shutil
    import urllib.request

    start = time.perf_counter()
    if shutil.which("curl"):
        subprocess.run(["curl", "-sf", "-o", str(out), url], check=True)
    else:
        with urllib.request.urlopen(url) as response, out.open("wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
    seconds = time.perf_counter() - start
    out.unlink()
    return seconds


def build(
    project: Path, package: str, table: str, models: str, out: Path, env: dict[str, str], **constants: object
) -> Sampled:
    """Write a project of one package, its models from ``projects/models``, and build its wheel into
    ``out``: ``sampled``'s figures."""
    write_package(project, package, models, **constants)
    (project / "pyproject.toml").write_text(HEADER.format(name=package) + table)
    return sampled(build_command(project, out), env, project)


def fixed_cost(project: Path, env: dict[str, str]) -> Sampled:
    """The same build of a model without weights to speak of: what torch and the compile stack cost."""
    return build(project, "fixedpkg", FIXED, "fixed_models.py", project / "dist", env)


def load(site: Path, out: Path, cache: Path) -> dict[str, Any]:
    """A fresh process's first ``compiled.load`` with ``cache`` as the weights cache, and its first call."""
    env = {**os.environ, "HATCH_AOTI_WEIGHTS_CACHE": str(cache)}
    env.pop("PYTHONPATH", None)
    return dict(json.loads(run_child("llm_fetch", site, out, env=env).splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=22, help="22: TinyLlama's 1.1B parameters")
    parser.add_argument("--rounds", type=int, default=5, help="cold fetches, each beside a curl of the same file")
    parser.add_argument(
        "--weights", choices=("external", "mapped"), default="external", help="mapped: the build's figures only"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="hatch-aoti-llm-") as tmp:
        work = Path(tmp)
        served = work / "served"
        served.mkdir()
        httpd, port = serve(served)
        project = work / "project"
        table = PYPROJECT.format(url=f"http://127.0.0.1:{port}/{{file}}")
        env = {**os.environ, "HATCH_AOTI_NO_CACHE": "1", "TMPDIR": str(work)}
        table = table if args.weights == "external" else MAPPED
        built = build(project, "llmpkg", table, "llm_models.py", work / "dist", env, LAYERS=args.layers)
        wheel = only_wheel(work / "dist")
        if args.weights == "external":
            (weights,) = (work / "dist-weights").iterdir()  # beside the wheel's dist/
        else:
            weights = unpack(wheel, work / "site") / "llmpkg" / "_aoti" / "llama" / "weights.bin"
        size = weights.stat().st_size
        print(f"weights {size / 1e9:.2f} GB ({weights.name}, {args.weights})")
        print(
            f"build: {built.seconds:.0f} s; peak RSS of its largest process (ru_maxrss, GNU time's %M) "
            f"{built.maxrss / 1e9:.2f} GB, {built.maxrss / size:.2f}x the weights; sampled every 20 ms: "
            f"largest {built.largest / 1e9:.2f} GB ({built.peaked}), all processes {built.total / 1e9:.2f} GB"
        )
        for line in built.output.splitlines():
            if line.startswith("aoti:"):
                print(f"  {line}")
        print(f"wheel {wheel.stat().st_size / 1e6:.2f} MB")
        fixed = fixed_cost(work / "fixed", env)
        print(
            f"the same build of a model with no weights to speak of: largest process {fixed.maxrss / 1e9:.2f} GB "
            f"(ru_maxrss; {fixed.peaked}); taken off, the build's largest process peaks at "
            f"{(built.maxrss - fixed.maxrss) / size:.2f}x the weights (goal: <= 1.2x)"
        )
        if args.weights != "external":
            return
        os.link(weights, served / weights.name)
        site = unpack(wheel, work / "site")
        out = work / "y.pt"
        url = f"http://127.0.0.1:{port}/{weights.name}"
        loads, reads = [], []
        for round_ in range(args.rounds):  # a fresh cache each round; curl after, so neither warms the other
            first = load(site, out, work / f"cache-{round_}")
            loads.append(first["load"])
            reads.append(plain_read(url, work / "curl.bin"))
            if round_:
                shutil.rmtree(work / f"cache-{round_}")
        cached = load(site, out, work / "cache-0")
        ratios = sorted(r / f for r, f in zip(reads, loads))
        print(
            f"first load (fetch, verify, map), {args.rounds} rounds: {statistics.median(loads):.1f} s "
            f"(each: {', '.join(f'{s:.1f}' for s in loads)}) against curl fetching the same file "
            f"{statistics.median(reads):.1f} s (each: {', '.join(f'{s:.1f}' for s in reads)}): "
            f"{statistics.median(ratios):.2f} of its speed (median of the rounds' ratios, range "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}); a cached load {cached['load']:.2f} s"
        )
        rss, torch_only = cached["rss"], cached["rss_torch"]
        grew = {k: (rss[k] - torch_only[k]) / 1e9 for k in ("RssAnon", "RssFile")}
        print(
            f"a cached load and a call add to `import torch`'s RSS {grew['RssAnon']:.2f} GB anonymous and "
            f"{grew['RssFile']:.2f} GB of mapped files, against {size / 1e9:.2f} GB of weights"
        )
        import torch

        sys.path.insert(0, str(project))
        from llmpkg.models import llama

        ids = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            eager = llama()(ids)
        compiled = torch.load(out)
        print(
            f"max abs err against eager {float((compiled.float() - eager.float()).abs().max()):.3g} (bfloat16 logits)"
        )
        httpd.shutdown()


if __name__ == "__main__":
    main()
