"""The two built-in backends on the same models, side by side: build time, size, cold start, per call.

Builds one wheel holding sample_project's two models twice over, once per backend
(`python -m build --no-isolation`, one model at a time so that each compile time is its
own), unpacks it, and measures in fresh processes. Run with the test venv:
`.venv-test/bin/python benchmarks/backends.py`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
from importlib.metadata import version
from pathlib import Path

from common import REPO, build_wheel, run_child, unpack, wall

MODELS = {
    "mlp": ("sample_models.models:build_mlp", "inputs = [{ shape = [4, 128] }]", "torch.randn(4, 128)"),
    "classifier": (
        "sample_models.models:build_classifier",
        "inputs = [{ shape = [8, 3, 16, 16] }]",
        "torch.rand(8, 3, 16, 16)",
    ),
}
BACKENDS = ("aoti", "precompile")


def project(root: Path) -> Path:
    shutil.copytree(REPO / "sample_project", root, ignore=shutil.ignore_patterns("dist", "build"))
    text = (root / "pyproject.toml").read_text().split("[tool.hatch.build.targets.wheel.hooks.aoti]")[0]
    # precompiled models load only under the torch that built them: the wheel pins it exactly
    torch = version("torch").split("+")[0]
    text = text.replace('dependencies = ["torch==2.13.*"]', f'dependencies = ["torch=={torch}"]')
    for name, (factory, inputs, _) in MODELS.items():
        for backend in BACKENDS:
            text += (
                f"\n[tool.hatch.build.targets.wheel.hooks.aoti.models.{name}_{backend}]\n"
                f'backend = "{backend}"\nfactory = "{factory}"\n{inputs}\n'
            )
    (root / "pyproject.toml").write_text(text)
    return root


def build(root: Path, env: dict[str, str]) -> tuple[Path, dict[str, float]]:
    wheel, _, log = build_wheel(root, root / "dist", env)
    seconds = {m: float(s) for m, s in re.findall(r"aoti: (\w+): compiled in ([\d.]+)s", log)}
    return wheel, seconds


def per_call_us(site: Path, model: str, sample: str, env: dict[str, str]) -> float:
    return float(run_child("backends_call", site, model, sample, env=env).split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=5, help="cold starts measured per model and backend")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {
            **os.environ,
            "HATCH_AOTI_CACHE_DIR": str(work / "cache"),
            "HATCH_AOTI_JOBS": "1",
            "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-build"),
        }
        wheel, seconds = build(project(work / "proj"), env)
        site = unpack(wheel, work / "site")
        run_env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-run")}
        print(f"{wheel.name}: torch and Python as built; each model on its own process per measure\n")
        for name, (_, _, sample) in MODELS.items():
            base: list[float] = []
            loads: dict[str, list[float]] = {b: [] for b in BACKENDS}
            first = {}
            for backend in BACKENDS:  # the first load of a precompiled model compiles its kernels
                code = (
                    f"import sys, torch; sys.path.insert(0, {str(site)!r}); from sample_models import compiled;"
                    f"compiled.load({f'{name}_{backend}'!r})({sample})"
                )
                first[backend] = wall(code, run_env)
            for _ in range(args.pairs):
                base.append(wall("import torch", run_env))
                for backend in BACKENDS:
                    code = (
                        f"import sys, torch; sys.path.insert(0, {str(site)!r}); from sample_models import "
                        f"compiled; compiled.load({f'{name}_{backend}'!r})({sample})"
                    )
                    loads[backend].append(wall(code, run_env))
            torch_s = statistics.median(base)
            print(f"{name}: import torch {torch_s:.2f}s (median of {args.pairs})")
            for backend in BACKENDS:
                model = f"{name}_{backend}"
                size = sum(
                    p.stat().st_size for p in (site / "sample_models" / "_aoti" / model).rglob("*") if p.is_file()
                )
                cold = statistics.median(loads[backend])
                call = per_call_us(site, model, sample, run_env)
                print(
                    f"  {backend:10s} build {seconds[model]:5.1f}s  artifact {size / 1e6:6.2f} MB  "
                    f"cold start {cold / torch_s:4.2f}x import torch (first load {first[backend] / torch_s:4.2f}x)  "
                    f"per call {call:7.1f} us"
                )


if __name__ == "__main__":
    main()
