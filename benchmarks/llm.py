"""A 1.1B-parameter Llama in bfloat16 with external weights: build time and memory, wheel, fetch, error.

The model has TinyLlama's shape (`transformers.LlamaConfig`: hidden 2048, 22 layers, 32 heads,
4 key-value heads, vocabulary 32000; seeded random weights, about 2.2 GB), called on 1 x 32
tokens for the last token's logits. It is built with `weights = "external"` by
`python -m build --no-isolation` while the RSS of the build's whole process tree is sampled.
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
import textwrap
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from big import sampled

MODELS = """
import torch
from torch import nn


class LastLogits(nn.Module):
    def __init__(self, layers):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, use_cache=False,
        )
        self.llama = LlamaForCausalLM(config)

    def forward(self, input_ids):
        return self.llama(input_ids=input_ids).logits[:, -1, :]


def llama():
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bfloat16: never a float32 copy
    try:
        return LastLogits({layers}).eval()
    finally:
        torch.set_default_dtype(default)
"""
HEADER = """
[build-system]
requires = ["hatchling", "hatch-aoti", "torch==2.13.*"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0"
dependencies = ["torch==2.13.*"]
"""
PYPROJECT = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.llama]
factory = "llmpkg.models:llama"
inputs = [{{ shape = [1, 32], dtype = "int64", high = 32000 }}]
weights = "external"
weights-url = "{url}"
"""
#: The same build of a model with next to no weights: what torch and the compile stack cost alone.
FIXED = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.tiny]
factory = "fixedpkg.models:tiny"
inputs = [{ shape = [1, 8], dtype = "bfloat16" }]
"""
FIXED_MODELS = """
import torch


def tiny():
    return torch.nn.Linear(8, 8, dtype=torch.bfloat16).eval()
"""
FETCH = """
import json, sys, time
sys.path.insert(0, {site!r})
import torch
from llmpkg import compiled
def rss():
    fields = (line.split(":", 1) for line in open("/proc/self/status"))
    return {{k: int(v.split()[0]) * 1024 for k, v in fields if k.startswith("Rss")}}
ids = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1))
before = rss()
start = time.perf_counter()
model = compiled.load("llama")
loaded = time.perf_counter() - start
start = time.perf_counter()
y = model(ids)
call = time.perf_counter() - start
torch.save(y, {out!r})
print(json.dumps({{"load": loaded, "first_call": call, "rss": rss(), "rss_torch": before}}))
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
    project: Path, package: str, table: str, models: str, out: Path, env: dict[str, str]
) -> tuple[float, int, int, str]:
    """Write a project of one package and build its wheel into ``out``: ``sampled``'s figures."""
    (project / package).mkdir(parents=True)
    (project / "pyproject.toml").write_text(HEADER.format(name=package) + table)
    (project / package / "__init__.py").write_text("")
    (project / package / "models.py").write_text(textwrap.dedent(models))
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(project)]
    return sampled(cmd, env, project)


def fixed_cost(project: Path, env: dict[str, str]) -> int:
    """Peak RSS, over all processes, of the same build of a model without weights to speak of."""
    return build(project, "fixedpkg", FIXED, FIXED_MODELS, project / "dist", env)[1]


def load(site: Path, out: Path, cache: Path) -> dict[str, Any]:
    """A fresh process's first ``compiled.load`` with ``cache`` as the weights cache, and its first call."""
    env = {**os.environ, "HATCH_AOTI_WEIGHTS_CACHE": str(cache)}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", FETCH.format(site=str(site), out=str(out))], capture_output=True, text=True, env=env
    )
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return dict(json.loads(proc.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=22, help="22: TinyLlama's 1.1B parameters")
    parser.add_argument("--rounds", type=int, default=5, help="cold fetches, each beside a curl of the same file")
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
        models = MODELS.replace("{layers}", str(args.layers))
        env = {**os.environ, "HATCH_AOTI_NO_CACHE": "1", "TMPDIR": str(work)}
        seconds, peak, largest, output = build(project, "llmpkg", table, models, work / "dist", env)
        (weights,) = (work / "dist-weights").iterdir()  # beside the wheel's dist/
        size = weights.stat().st_size
        (wheel,) = (work / "dist").glob("*.whl")
        print(f"weights {size / 1e9:.2f} GB ({weights.name})")
        ratios = f"all processes {peak / size:.2f}x the weights, largest {largest / size:.2f}x"
        print(f"build: {seconds:.0f} s; peak RSS, {ratios}")
        for line in output.splitlines():
            if line.startswith("aoti:"):
                print(f"  {line}")
        print(f"wheel {wheel.stat().st_size / 1e6:.2f} MB")
        fixed = fixed_cost(work / "fixed", env)
        print(
            f"the same build of a model with no weights to speak of peaks at {fixed / 1e9:.2f} GB in all; "
            f"taken off, the build peaks at {(peak - fixed) / size:.2f}x the weights"
        )
        os.link(weights, served / weights.name)
        site = work / "site"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
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
