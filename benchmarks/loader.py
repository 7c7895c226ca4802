"""Loader benchmark for an installed sample-models wheel (run by benchmarks/run.sh).

Prints ratios measured side by side in this one run:
- cold start (fresh process to first output) vs ``python -c "import torch"``, and the
  same for ``torch._inductor.aoti_load_package`` on the same model;
- per call vs the raw AOTInductor runner on the same shared library, vs
  ``aoti_load_package``'s model, and vs eager (min of repeats, interleaved);
- files written while loading (strace, where available, and a watched TMPDIR).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import wall

INPUTS = {"mlp": "torch.randn(4, 128)", "classifier": "torch.rand(8, 3, 16, 16)"}


def cold_start(name: str, pairs: int, pt2: str) -> None:
    baseline = "import torch"
    ours = f"import torch; from sample_models import compiled; compiled.load({name!r})({INPUTS[name]})"
    public = (
        "import torch, torch._inductor, warnings; warnings.simplefilter('ignore');"
        f"torch._inductor.aoti_load_package({pt2!r})({INPUTS[name]})"
    )
    wall(ours), wall(public)  # page cache warm for all three
    t_torch, t_ours, t_public = [], [], []
    for _ in range(pairs):
        t_torch.append(wall(baseline))
        t_ours.append(wall(ours))
        t_public.append(wall(public))
    r_ours = statistics.median(o / b for o, b in zip(t_ours, t_torch))
    r_public = statistics.median(p / b for p, b in zip(t_public, t_torch))
    print(
        f"  cold start, median of {pairs} paired runs: import torch {statistics.median(t_torch):.3f}s, "
        f"compiled.load {statistics.median(t_ours):.3f}s, aoti_load_package {statistics.median(t_public):.3f}s"
    )
    print(f"    compiled.load / import torch     = {r_ours:.3f}  (goal <= 1.15)")
    print(f"    aoti_load_package / import torch = {r_public:.3f}")


def per_call(name: str, pt2: str, repeat: int, number: int) -> None:
    import logging
    import warnings

    import torch
    import torch._inductor
    from sample_models import compiled, models
    from torch.utils import benchmark

    x = eval(INPUTS[name], {"torch": torch})
    ours = compiled.load(name)
    # The same runner object underneath: two runners on one library differ by several
    # percent (memory placement), which would swamp the loader's own overhead.
    raw = ours.runner
    # torch logs an ISA "mismatch" whenever the host's widest ISA differs from the build's,
    # even for a host that is a superset (the hook's own check is exact): keep it quiet here.
    logging.getLogger("torch.export.pt2_archive").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        public = torch._inductor.aoti_load_package(pt2)
    eager = getattr(models, f"build_{name}")()
    # torch's own runner on the same library: it holds the GIL for the call, the loader's container does not
    held = torch._C._aoti.AOTIModelContainerRunnerCpu(ours.file, 1)
    variants = {
        "raw runner": lambda: raw.run([x]),
        "torch runner": lambda: held.run([x]),
        "compiled.load": lambda: ours(x),
        "aoti_load_package": lambda: public(x),
        "eager": lambda: eager(x),
    }
    best = dict.fromkeys(variants, float("inf"))
    threads = torch.get_num_threads()
    timers = {label: benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads) for label, fn in variants.items()}
    with torch.inference_mode():
        for _ in range(repeat):
            for label, timer in timers.items():
                best[label] = min(best[label], timer.timeit(number).mean)
    us = {k: v * 1e6 for k, v in best.items()}
    print(f"  per call, min of {repeat} x {number} calls: " + ", ".join(f"{k} {v:.1f}us" for k, v in us.items()))
    print(f"    compiled.load / raw runner        = {us['compiled.load'] / us['raw runner']:.3f}  (goal <= 1.10)")
    print(f"    raw runner / torch runner         = {us['raw runner'] / us['torch runner']:.3f}  (no GIL)")
    print(f"    compiled.load / aoti_load_package = {us['compiled.load'] / us['aoti_load_package']:.3f}")
    print(f"    compiled.load / eager             = {us['compiled.load'] / us['eager']:.3f}")


def files_written(name: str) -> None:
    code = f"import torch; from sample_models import compiled; compiled.load({name!r})({INPUTS[name]})"
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TMPDIR": tmp}
        wall(code, env)
        leftovers = list(Path(tmp).iterdir())
        strace = shutil.which("strace")
        if strace:
            log = Path(tmp) / "strace.log"
            subprocess.run(
                [
                    strace,
                    "-f",
                    "-qq",
                    "-e",
                    "trace=openat,open,creat,mkdir,mkdirat,rename,renameat2,memfd_create",
                    "-o",
                    str(log),
                    sys.executable,
                    "-c",
                    code,
                ],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
            )
            writes = [
                line.strip()
                for line in log.read_text().splitlines()
                if (
                    "O_CREAT" in line
                    or "O_WRONLY" in line
                    or "O_RDWR" in line
                    or "mkdir" in line
                    or "rename" in line
                    or "creat(" in line
                    or "memfd_create" in line
                )
                and "= -1" not in line
                and "/dev/" not in line
            ]
            print(f"  files written at load (strace): {len(writes)}")
            for line in writes[:10]:
                print(f"    {line}")
        print(f"  files left in TMPDIR: {len(leftovers)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--models", nargs="*", default=list(INPUTS))
    args = parser.parse_args()

    import torch
    from sample_models import compiled

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            pt2 = compiled.save_pt2(name, os.path.join(tmp, f"{name}.pt2"))
            print(f"\n{name}:")
            cold_start(name, args.pairs, pt2)
            per_call(name, pt2, args.repeat, args.number)
            files_written(name)


if __name__ == "__main__":
    main()
