"""Per-call cost of the loader for each call structure, against the raw runner on the same inputs.

Builds a wheel of four small models (with this interpreter, which has hatch-aoti and torch),
unpacks it, and times in this one process, interleaved round by round:
- ``compiled.load(name)(...)``: the call as a user makes it;
- ``model.runner.run(flat_tensors)``: the same AOTInductor runner on the inputs already flattened;
- the eager model, for reference.

Usage: ``.venv-test/bin/python benchmarks/calls.py [--rounds 7] [--loader LOADER_DIR]``. Prints microseconds per
call (the median of each round's ``torch.utils.benchmark`` measurement, then the smallest
over the rounds) and the loader's overhead over the raw runner.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from common import build_wheel, unpack, write_package

HOOK = """
[build-system]
requires = ["hatchling", "hatch-aoti"]
build-backend = "hatchling.build"

[project]
name = "callbench"
version = "1.0"
dependencies = ["{torch}"]

[tool.hatch.build.targets.wheel.hooks.aoti.models.positional]
factory = "callbench.models:positional"
inputs = [{ shape = [4, 16] }, { shape = [4, 8] }]

[tool.hatch.build.targets.wheel.hooks.aoti.models.keyword_only]
factory = "callbench.models:keyword_only"
example-inputs = "callbench.models:keyword_samples"

[tool.hatch.build.targets.wheel.hooks.aoti.models.nested]
factory = "callbench.models:nested"
example-inputs = "callbench.models:nested_samples"

[tool.hatch.build.targets.wheel.hooks.aoti.models.dict_out]
factory = "callbench.models:dict_out"
inputs = [{ shape = [4, 16] }]
"""


def build(root: Path) -> Path:
    """The benchmark's wheel, built without isolation by this interpreter, unpacked under ``root``."""
    project = root / "project"
    write_package(project, "callbench", "call_models.py")
    from importlib.metadata import version

    series = ".".join(version("torch").split(".")[:2])
    (project / "pyproject.toml").write_text(
        textwrap.dedent(HOOK).replace("{torch}", f"torch=={series}.*"), encoding="utf-8"
    )
    wheel, _, _ = build_wheel(project, root / "dist", failure="the benchmark's wheel did not build")
    return unpack(wheel, root / "site")


def cases() -> dict[str, tuple[tuple[Any, ...], dict[str, Any], list[Any]]]:
    """(args, kwargs, the same tensors flattened in compiled order) of each model."""
    import torch

    x, y, s, b = torch.randn(4, 16), torch.randn(4, 8), torch.randn(4, 1), torch.randn(8)
    xs, parts = [torch.randn(4, 8), torch.randn(4, 8)], {"a": torch.randn(8), "b": torch.randn(8)}
    return {
        "positional": ((x, y), {}, [x, y]),
        "keyword_only": ((x,), {"scale": s, "bias": b}, [x, s, b]),
        "nested": ((xs, parts), {}, [*xs, parts["a"], parts["b"]]),
        "dict_out": ((x,), {}, [x]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--loader", type=Path, help="time this loader package (a hatch_aoti/loader folder) instead")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site = build(Path(tmp))
        if options.loader:
            shutil.rmtree(site / "callbench" / "compiled")
            skip = shutil.ignore_patterns("__pycache__")
            shutil.copytree(options.loader, site / "callbench" / "compiled", ignore=skip)
        sys.path.insert(0, str(site))
        import torch
        from callbench import compiled, models
        from torch.utils.benchmark import Timer

        torch.set_num_threads(1)
        print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus, 1 thread")
        print(f"{'model':<14}{'compiled':>10}{'raw runner':>12}{'eager':>9}{'overhead':>10}")
        for name, (args, kwargs, flat) in cases().items():
            model, eager = compiled.load(name), getattr(models, name)()
            calls = {
                "compiled": lambda model=model, args=args, kwargs=kwargs: model(*args, **kwargs),  # type: ignore[misc]
                "raw": lambda model=model, flat=flat: model.runner.run(flat),
                "eager": lambda eager=eager, args=args, kwargs=kwargs: eager(*args, **kwargs),  # type: ignore[misc]
            }
            best = dict.fromkeys(calls, float("inf"))
            with torch.inference_mode():
                for _ in range(options.rounds):
                    for label, fn in calls.items():
                        measured = Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2)
                        best[label] = min(best[label], measured.median * 1e6)
            over = best["compiled"] - best["raw"]
            print(
                f"{name:<14}{best['compiled']:>8.2f}us{best['raw']:>10.2f}us{best['eager']:>7.2f}us"
                f"{over:>+8.2f}us  (goal <= +3)"
            )


if __name__ == "__main__":
    main()
