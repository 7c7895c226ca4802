"""What ``cpp.dynamic_threads = true`` (a hatch-aoti wheel default) costs per call.

Compiles sample_project's models twice in this process, with Inductor's default (the
build machine's thread count written into the kernels) and with dynamic threads, then
times calls of both libraries side by side, interleaved, at 1 thread and at all threads.
Run with the test venv: `.venv-test/bin/python benchmarks/threads.py`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sample_project" / "src"))

from sample_models.models import build_classifier, build_mlp  # noqa: E402

from hatch_aoti.backends import aoti  # noqa: E402
from hatch_aoti.settings.cpu_targets import resolve  # noqa: E402

MODELS = {"mlp": (build_mlp, torch.randn(4, 128)), "classifier": (build_classifier, torch.rand(8, 3, 16, 16))}


def compile_runner(module: torch.nn.Module, sample: torch.Tensor, dynamic: bool, work: Path) -> Any:
    exported = torch.export.export(module, (sample,))
    configs = {**aoti.inductor_configs({}, resolve("x86-64-v3")), "cpp.dynamic_threads": dynamic}
    files = aoti.compile_program(exported, work / "art", configs, work)
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(work / "art" / files["file"]), 1)


def per_call_us(runner: Any, sample: torch.Tensor, number: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(number):
        runner.run([sample])
    return (time.perf_counter() - start) / number * 1e6


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, (build, sample) in MODELS.items():
            runners = {}
            for dynamic in (False, True):
                work = Path(tmp) / f"{name}-{dynamic}"
                work.mkdir()
                runners[dynamic] = compile_runner(build(), sample, dynamic, work)
            for threads in (1, torch.get_num_threads()):
                torch.set_num_threads(threads)
                times: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(20):
                    for dynamic, runner in runners.items():
                        times[dynamic].append(per_call_us(runner, sample))
                fixed, dyn = min(times[False]), min(times[True])
                print(
                    f"{name:10s} {threads} thread(s): fixed {fixed:7.1f} us, dynamic {dyn:7.1f} us, "
                    f"dynamic / fixed = {dyn / fixed:.3f}"
                )


if __name__ == "__main__":
    main()
