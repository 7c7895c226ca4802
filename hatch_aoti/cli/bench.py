"""``hatch-aoti bench``: per-call latency, compiled against eager, and cold start against ``import torch``.

Compiled and eager rounds alternate, so both see the same machine load; each round runs
enough calls to last ``--min-time``, and the spread is that of the rounds. Cold start
times fresh processes, alternating one that imports torch with one that also loads the
model and calls it once.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from hatch_aoti.cli import calls, models
from hatch_aoti.cli.output import Output
from hatch_aoti.cli.target import Target


def run(target: Target, out: Output, name: str | None, eager: bool, warmup: int, repeats: int, min_time: float,
        cold: int) -> int:  # fmt: skip
    if name:
        target.model(name)  # an unknown name is an error
    names = [name] if name else list(target.models)
    results = {}
    work = sum(len(calls.cases(target.model(n))) + (cold > 0) for n in names)
    with out.progress(work, "benchmarking") as step:
        for model_name in names:
            results[model_name] = bench_model(target, model_name, eager, (warmup, repeats, min_time), cold, step)
    data = {"target": target.where, "models": results}
    out.data(data)
    if not out.json:
        show(data, out)
    return 0


def bench_model(target: Target, name: str, eager: bool, timing: tuple[int, int, float], cold: int,
                step: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    import torch

    try:
        compiled = models.compiled(target, name, eager)
    except models.Unavailable as exc:
        return {"skipped": str(exc)}
    module, why_no_eager = None, "not asked for (--eager)"
    if eager:
        try:
            module, why_no_eager = models.eager(target, name), ""
        except models.Unavailable as exc:
            why_no_eager = str(exc)
    entry = target.model(name)
    rows = []
    for case in calls.cases(entry):
        args, kwargs = calls.make_inputs(entry, case.sizes, calls.in_spec(entry, compiled))
        fns = {"compiled": lambda: compiled(*args, **kwargs)}
        if module is not None:
            fns["eager"] = lambda: module(*args, **kwargs)
        with torch.no_grad():
            times = side_by_side(fns, *timing)
        rows.append({"case": case.label, "inputs": calls.describe(entry, case.sizes), **times})
        step(f"{name} {case.label}")
    result: dict[str, Any] = {"per_call": rows, "eager": why_no_eager or "measured"}
    if cold:
        result["cold_start"] = cold_start(target, name, calls.in_spec(entry, compiled), eager, cold)
        step(f"{name} cold start")
    return result


def side_by_side(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int, min_time: float) -> dict[str, Any]:
    """Seconds per call of each function: median and range of ``repeats`` interleaved rounds."""
    number = {}
    for label, fn in fns.items():
        for _ in range(max(warmup, 1)):
            start = time.perf_counter()
            fn()
            once = time.perf_counter() - start
        number[label] = max(1, int(min_time / max(once, 1e-7)))
    rounds: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            start = time.perf_counter()
            for _ in range(number[label]):
                fn()
            rounds[label].append((time.perf_counter() - start) / number[label])
    return {label: {"median_s": statistics.median(r), "min_s": min(r), "max_s": max(r), "calls": number[label] * repeats}
            for label, r in rounds.items()}  # fmt: skip


_CHILD = """
import importlib.util, json, sys
name, path, model, sizes, structure = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location(name, path)
loader = importlib.util.module_from_spec(spec)
sys.modules[name] = loader
spec.loader.exec_module(loader)
from hatch_aoti.cli.calls import make_inputs
args, kwargs = make_inputs(loader.info(model), sizes, structure)
loader.load(model)(*args, **kwargs)
"""


def cold_start(target: Target, name: str, spec: str, package_code: bool, rounds: int) -> dict[str, Any]:
    """Fresh process to the first output, and fresh process to ``import torch``: medians and their ratio."""
    loader = target.package_dir / f"{target.loader_name}.py"
    job = json.dumps([f"{target.package}.{target.loader_name}", str(loader), name,
                      calls.example_sizes(target.model(name)), spec])  # fmt: skip
    env = dict(os.environ)
    if package_code and target.import_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target.import_root), env.get("PYTHONPATH")]))
    commands = {"import_torch": [sys.executable, "-c", "import torch"], "first_output": [sys.executable, "-c", _CHILD, job]}
    times: dict[str, list[float]] = {label: [] for label in commands}
    for _ in range(rounds):
        for label, command in commands.items():
            start = time.perf_counter()
            proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            times[label].append(time.perf_counter() - start)
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
                return {"error": f"the fresh process failed: {tail[0]}"}
    medians = {label: statistics.median(t) for label, t in times.items()}
    return {**{f"{label}_s": m for label, m in medians.items()},
            "ratio": medians["first_output"] / medians["import_torch"], "rounds": rounds}  # fmt: skip


def show(data: dict[str, Any], out: Output) -> None:
    for name, r in data["models"].items():
        if "skipped" in r:
            out.line(f"{name}: skipped: {r['skipped']}", style="yellow")
            continue
        rows = []
        for row in r["per_call"]:
            compiled, eager = row["compiled"], row.get("eager")
            speedup = f"{eager['median_s'] / compiled['median_s']:.2f}x" if eager else "-"
            rows.append([row["case"], row["inputs"], _us(compiled), _us(eager) if eager else "-", speedup])
        out.table(["inputs", "shapes", "compiled", "eager", "eager/compiled"], rows,
                  title=f"{name}: per call, median (range over rounds)")  # fmt: skip
        if r["eager"] != "measured":
            out.line(f"{name}: eager not measured: {r['eager']}")
        start = r.get("cold_start")
        if start and "error" in start:
            out.line(f"{name}: cold start: {start['error']}", style="red")
        elif start:
            out.line(f"{name}: cold start, fresh process to first output {start['first_output_s']:.2f} s, "
                     f"import torch {start['import_torch_s']:.2f} s: {start['ratio']:.2f}x "
                     f"(medians of {start['rounds']})")  # fmt: skip


def _us(times: dict[str, float]) -> str:
    return f"{times['median_s'] * 1e6:.1f} us ({times['min_s'] * 1e6:.1f}-{times['max_s'] * 1e6:.1f})"
