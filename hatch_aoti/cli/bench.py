"""``hatch-aoti bench``: per-call latency, compiled against eager, and cold start against ``import torch``.

Compiled and eager rounds alternate, so both see the same machine load; each round runs
enough calls to last ``--min-time``, and the spread is that of the rounds. Cold start
times fresh processes, alternating one that imports torch with one that also loads the
model and calls it once.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from hatch_aoti.cli import calls, machine, models
from hatch_aoti.cli.output import Output
from hatch_aoti.cli.target import Target
from hatch_aoti.loader.schema import Entry


def run(
    target: Target,
    out: Output,
    name: str | None,
    package_code: bool,
    eager: bool,
    timing: tuple[int, int, float],
    cold: int,
) -> int:
    if name:
        target.model(name)  # an unknown name is an error
    names = [name] if name else list(target.models)
    results = {}
    work = sum(len(calls.cases(target.model(n))) + (cold > 0) for n in names)
    with out.progress(work, "benchmarking") as step:
        for model_name in names:
            results[model_name] = bench_model(target, model_name, package_code, eager, timing, cold, step)
    data = {"target": target.where, "models": results}
    out.data(data)
    if not out.json:
        show(data, out)
    measured = any("error" not in row for result in results.values() for row in result.get("per_call", []))
    return 0 if measured else 1


def bench_model(
    target: Target,
    name: str,
    package_code: bool,
    eager: bool,
    timing: tuple[int, int, float],
    cold: int,
    step: Callable[[str], None],
) -> dict[str, Any]:
    try:
        compiled = models.compiled(target, name, package_code)
        others = models.other_variants(target, name, package_code)
    except models.Unavailable as exc:
        return {"skipped": str(exc)}
    module, why_no_eager = None, "not asked for (--eager)"
    if eager:
        try:
            module, why_no_eager = models.eager(target, name), ""
        except models.Unavailable as exc:
            why_no_eager = str(exc)
    entry = target.model(name)
    spec = calls.in_spec(entry, compiled)
    rows = []
    for case in calls.cases(entry):
        rows.append(
            {
                "case": case.label,
                "inputs": calls.describe(entry, case.sizes),
                **per_call(entry, case, spec, {"compiled": compiled, **others}, module, timing),
            }
        )
        step(f"{name} {case.label}")
    loads = machine.loaded(target, name)
    result: dict[str, Any] = {"per_call": rows, "eager": why_no_eager or "measured", "precision": loads}
    if cold:
        result["cold_start"] = cold_start(target, name, spec, package_code, cold)
        step(f"{name} cold start")
    return result


def per_call(
    entry: Entry, case: calls.Case, spec: str, compiled: Mapping[str, Any], module: Any, timing: tuple[int, int, float]
) -> dict[str, Any]:
    """Timings at one case of the variant that loads here (``compiled``), the others this CPU runs natively
    (by precision), and eager; ``error`` instead if a call fails."""
    import torch

    args, kwargs = calls.make_inputs(entry, case.sizes, spec)
    fns: dict[str, Callable[[], Any]] = {
        label: functools.partial(fn, *args, **kwargs) for label, fn in compiled.items()
    }
    if module is not None:
        fns["eager"] = lambda: module(*args, **kwargs)
    try:
        with torch.no_grad():
            return side_by_side(fns, *timing)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {models.first_line(exc)}"}


def side_by_side(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int, min_time: float) -> dict[str, Any]:
    """Seconds per call of each function: median and range of ``repeats`` interleaved rounds, each a
    ``torch.utils.benchmark`` blocked autorange of ``min_time`` (which waits for CUDA work itself),
    with this process's threads."""
    import torch
    from torch.utils import benchmark

    threads = torch.get_num_threads()
    timers = {label: benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads) for label, fn in fns.items()}
    for timer in timers.values():
        if warmup:
            timer.timeit(warmup)
    rounds: dict[str, list[float]] = {label: [] for label in fns}
    calls_made = dict.fromkeys(fns, 0)
    for _ in range(repeats):
        for label, timer in timers.items():
            measured = timer.blocked_autorange(min_run_time=min_time)
            rounds[label].append(measured.median)
            calls_made[label] += measured.number_per_run * len(measured.raw_times)
    return {
        label: {"median_s": statistics.median(r), "min_s": min(r), "max_s": max(r), "calls": calls_made[label]}
        for label, r in rounds.items()
    }


#: The fresh process of a cold start: the loader package by its path, zeros of the example's shapes, one call.
_CHILD = """
import importlib.util, json, os, sys
name, path, model, leaves, structure = json.loads(sys.argv[1])
init = os.path.join(path, "__init__.py")
spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[path])
loader = importlib.util.module_from_spec(spec)
sys.modules[name] = loader
spec.loader.exec_module(loader)
import torch
from torch.utils import _pytree
values = [leaf["const"] if "const" in leaf else torch.zeros(leaf["shape"], dtype=getattr(torch, leaf["dtype"]),
          device=leaf["device"]) for leaf in leaves]
args, kwargs = _pytree.tree_unflatten(values, _pytree.treespec_loads(structure))
loader.load(model)(*args, **kwargs)
"""


def cold_start(target: Target, name: str, spec: str, package_code: bool, rounds: int) -> dict[str, Any]:
    """Fresh process to the first output, and fresh process to ``import torch``, alternating after one
    unrecorded round of each: medians, ranges, and the ratio of the medians."""
    entry = target.model(name)
    job = json.dumps(
        [
            f"{target.package}.{target.loader_name}",
            str(target.package_dir / target.loader_name),
            name,
            calls.leaves_at(entry, calls.example_sizes(entry)),
            spec,
        ]
    )
    env = dict(os.environ)
    if package_code and target.import_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target.import_root), env.get("PYTHONPATH")]))
    commands = {
        "import_torch": [sys.executable, "-c", "import torch"],
        "first_output": [sys.executable, "-c", _CHILD, job],
    }
    times: dict[str, list[float]] = {label: [] for label in commands}
    for round_number in range(rounds + 1):
        for label, command in commands.items():
            start = time.perf_counter()
            proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if round_number:
                times[label].append(time.perf_counter() - start)
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
                return {"error": f"the fresh process failed: {tail[0]}"}
    result: dict[str, Any] = {"rounds": rounds}
    for label, measured in times.items():
        result[label] = {"median_s": statistics.median(measured), "min_s": min(measured), "max_s": max(measured)}
    result["ratio"] = result["first_output"]["median_s"] / result["import_torch"]["median_s"]
    return result


def show(data: dict[str, Any], out: Output) -> None:
    for name, r in data["models"].items():
        if "skipped" in r:
            out.line(f"{name}: skipped: {r['skipped']}", style="yellow")
            continue
        others = sorted({k for row in r["per_call"] for k in row} & {"float32", "bfloat16", "int8"})
        loads = f" ({r['precision']})" if r.get("precision") and (others or r["precision"] != "float32") else ""
        out.table(
            ["inputs", "shapes", f"compiled{loads}", *others, "eager", "eager/compiled"],
            [_row(row, others) for row in r["per_call"]],
            title=f"{name}: per call, median (range over rounds)",
        )
        if r["eager"] != "measured":
            out.line(f"{name}: eager not measured: {r['eager']}")
        start = r.get("cold_start")
        if start and "error" in start:
            out.line(f"{name}: cold start: {start['error']}", style="red")
        elif start:
            first, torch = start["first_output"], start["import_torch"]
            out.line(
                f"{name}: cold start, fresh process to first output {_s(first)}, import torch {_s(torch)}: "
                f"{start['ratio']:.2f}x (medians of {start['rounds']})"
            )


def _row(row: dict[str, Any], others: list[str]) -> list[str]:
    if "error" in row:
        return [row["case"], row["inputs"], f"failed: {row['error']}", *[""] * len(others), "", ""]
    compiled, eager = row["compiled"], row.get("eager")
    speedup = f"{eager['median_s'] / compiled['median_s']:.2f}x" if eager else "-"
    variants = [_us(row[p]) if p in row else "-" for p in others]
    return [row["case"], row["inputs"], _us(compiled), *variants, _us(eager) if eager else "-", speedup]


def _us(times: dict[str, float]) -> str:
    return f"{times['median_s'] * 1e6:.1f} us ({times['min_s'] * 1e6:.1f}-{times['max_s'] * 1e6:.1f})"


def _s(times: dict[str, float]) -> str:
    return f"{times['median_s']:.2f} s ({times['min_s']:.2f}-{times['max_s']:.2f})"
