"""Every case of torch's export examples (``torch._export.db.examples``) that raw AOTInductor compiles
must build with hatch-aoti too: this script checks it, case by case.

For each case it tries raw AOTInductor (``torch.export.export``, ``aoti_compile_and_package``,
``aoti_load_package``, a call compared with eager), each case in a process of its own with a timeout so
that a crash is contained. The cases that pass go into one project, one model each, whose wheel is built
with hatch-aoti and installed into a fresh venv with torch but not hatch-aoti, where every model's
outputs (values and types) and the inputs it writes into are compared with the eager model's. It prints
a table and exits non-zero if any case that raw AOTInductor compiles fails with hatch-aoti.

    python scripts/export_examples.py                    # every case (12-21 min on 2 busy cores)
    python scripts/export_examples.py --cases dictionary,user_input_mutation --keep

Run it with an interpreter that has hatch-aoti (this checkout), torch and ``build`` installed (the test
venv): the wheel is built by it without isolation, or with ``--isolated`` as a user's build is, from a
wheel of this checkout. The script itself imports the standard library only at the top: the same file
runs as the raw AOTInductor child and as the check in the fresh venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "export_cases"
#: Raw AOTInductor's result where it compiles a case and computes eager's values, but returns other types
#: (a 0-d tensor for a Python ``int``): compiled, so hatch-aoti must build the case too.
RAW_TYPES = "ok, other types"
#: A raw AOTInductor case that takes longer than this (seconds) is stopped and counted as failed.
TIMEOUT = 600

#: The generated project's module: each case's model and example inputs, as the project's factories
#: and ``example-inputs`` callables, and as the raw run and the check in the fresh venv take them.
CASES_MODULE = '''\
"""The cases of torch's export examples as models and example inputs (generated)."""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
from typing import Any

import torch

NAMES: list[str] = {names!r}


def examples() -> dict[str, Any]:
    """torch's export examples, their random tensors (defaults of ``forward`` included) made from seed 0
    where this is the first import of them, so that every process holds the same values."""
    if "torch._export.db.examples" not in sys.modules:
        state = torch.random.get_rng_state()
        torch.manual_seed(0)
        importlib.import_module("torch._export.db.examples")
        torch.random.set_rng_state(state)
    from torch._export.db.examples import all_examples

    return all_examples()


def model(name: str) -> torch.nn.Module:
    return copy.deepcopy(examples()[name].model)


def samples(name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The case's example inputs; for a case with dynamic shapes, also one sample per dynamic dim with
    that dim one larger, so that hatch-aoti infers the same dims from the samples, and the case's extra
    inputs (those its graph must generalise to: ``extra_args``, or its module's ``extra_inputs``)."""
    case = examples()[name]
    first = copy.deepcopy((tuple(case.example_args), dict(case.example_kwargs)))
    if not case.dynamic_shapes:
        return [first]
    extra = case.extra_args or getattr(inspect.getmodule(type(case.model)), "extra_inputs", None)
    bound = inspect.signature(case.model.forward).bind(*first[0], **first[1]).arguments
    axes: dict[str, list[tuple[str, int]]] = {{}}
    for param, spec in case.dynamic_shapes.items():
        for axis, dim in (spec or {{}}).items():
            axes.setdefault(str(getattr(dim, "__name__", dim)), []).append((param, axis))
    out = [first]
    for members in axes.values():
        args, kwargs = copy.deepcopy(first)
        grown = inspect.signature(case.model.forward).bind(*args, **kwargs)
        for param, axis in members:
            tensor = bound[param]
            grown.arguments[param] = torch.cat([tensor, tensor.narrow(axis, 0, 1)], dim=axis)
        out.append((tuple(grown.args), dict(grown.kwargs)))
    if extra is not None:
        out.append(copy.deepcopy((tuple(extra), dict(case.example_kwargs))))
    return out


def _factory(name: str) -> Any:
    def factory() -> torch.nn.Module:
        return model(name)

    factory.__name__ = factory.__qualname__ = f"{{name}}_model"
    return factory


def _inputs(name: str) -> Any:
    def inputs() -> Any:
        found = samples(name)
        return found if len(found) > 1 else found[0]

    inputs.__name__ = inputs.__qualname__ = f"{{name}}_inputs"
    return inputs


for _name in NAMES:
    globals()[f"{{_name}}_model"] = _factory(_name)
    globals()[f"{{_name}}_inputs"] = _inputs(_name)
'''

PYPROJECT = """\
[build-system]
requires = ["hatchling", "hatch-aoti", "torch=={torch_series}.*"]
build-backend = "hatchling.build"

[project]
name = "export-cases"
version = "1.0"
dependencies = ["torch=={torch_series}.*"]

[tool.hatch.build.targets.wheel.hooks.aoti]
package = "{package}"
"""

MODEL_TABLE = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.{name}]
factory = "{package}.cases:{name}_model"
example-inputs = "{package}.cases:{name}_inputs"
"""


# -- comparison (in every process: torch imported by the caller) -----------------------------------


def compare(eager: Any, compiled: Any, where: str, types: bool = True) -> None:
    """``compiled`` is ``eager``: the same structure and types, tensors close (``assert_close``), other
    values equal. An ``AssertionError`` names the path that differs. With ``types`` false, a 0-d tensor
    where eager gives a Python number (as raw AOTInductor returns one) is compared by its value."""
    import torch

    if not types and isinstance(compiled, torch.Tensor) and isinstance(eager, (bool, int, float)):
        compiled = compiled.item()
    if type(compiled) is not type(eager):
        raise AssertionError(f"{where} is {type(compiled).__name__}, eager gives {type(eager).__name__}")
    if isinstance(eager, torch.Tensor):
        torch.testing.assert_close(compiled, eager, msg=lambda text: f"{where}: {text}")
    elif isinstance(eager, (list, tuple)):
        if len(compiled) != len(eager):
            raise AssertionError(f"{where} has {len(compiled)} items, eager gives {len(eager)}")
        for i, (e, c) in enumerate(zip(eager, compiled)):
            compare(e, c, f"{where}[{i}]", types)
    elif isinstance(eager, dict):
        if list(compiled) != list(eager):
            raise AssertionError(f"{where} has keys {list(compiled)}, eager gives {list(eager)}")
        for key in eager:
            compare(eager[key], compiled[key], f"{where}[{key!r}]", types)
    elif compiled != eager:
        raise AssertionError(f"{where} is {compiled!r}, eager gives {eager!r}")


def with_other_values(sample: Any) -> Any:
    """``sample`` with new random values in its floating-point tensors (integers and bools, which models
    may take as sizes or flags, kept): a compiled model must not have kept the values it was built with."""
    import torch
    from torch.utils import _pytree as pytree

    generator = torch.Generator().manual_seed(1)

    def other(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point:
            return torch.randn(leaf.shape, dtype=leaf.dtype, generator=generator)
        return leaf

    return pytree.tree_map(other, sample)


def run_and_compare(eager_model: Any, compiled: Any, sample: tuple[tuple[Any, ...], dict[str, Any]]) -> list[str]:
    """Eager and compiled called on copies of ``sample`` of their own: outputs and inputs after the call
    compared, types included; where only the types differ, what differs."""
    import copy

    eager_args, eager_kwargs = copy.deepcopy(sample)
    args, kwargs = copy.deepcopy(sample)
    expected = eager_model(*eager_args, **eager_kwargs)
    got = compiled(*args, **kwargs)
    found = []
    for what, eager, compiled_value in (
        ("output", expected, got),
        ("inputs after the call", (eager_args, eager_kwargs), (args, kwargs)),
    ):
        try:
            compare(eager, compiled_value, what)
        except AssertionError as exc:
            compare(eager, compiled_value, what, types=False)  # values that differ raise here
            found.append(str(exc))
    return found


def short(exc: BaseException, limit: int = 200) -> str:
    """One line of an exception: its type and the start of its message."""
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- child: raw AOTInductor on one case ---------------------------------------------------------------


def raw_case(project: Path, name: str, out: Path) -> dict[str, str]:
    """Raw AOTInductor on case ``name``: export, compile, load, call; the first stage that fails."""
    sys.path.insert(0, str(project))
    import torch
    from export_cases import cases

    case = cases.examples()[name]
    model = cases.model(name)
    args, kwargs = cases.samples(name)[0]
    try:
        exported = torch.export.export(model, args, kwargs, dynamic_shapes=case.dynamic_shapes)
    except Exception as exc:
        return {"result": "export failed", "detail": short(exc)}
    try:
        path = torch._inductor.aoti_compile_and_package(exported, package_path=str(out / f"{name}.pt2"))
    except Exception as exc:
        return {"result": "compile failed", "detail": short(exc)}
    try:
        loaded = torch._inductor.aoti_load_package(path)
    except Exception as exc:
        return {"result": "load failed", "detail": short(exc)}
    types = []
    try:
        for sample in cases.samples(name):
            for values in (sample, with_other_values(sample)):
                types += run_and_compare(cases.model(name), loaded, values)
    except AssertionError as exc:
        return {"result": "mismatch", "detail": short(exc)}
    except Exception as exc:
        return {"result": "run failed", "detail": short(exc)}
    if types:
        return {"result": RAW_TYPES, "detail": "; ".join(sorted(set(types)))}
    return {"result": "ok", "detail": ""}


# -- child: the installed wheel's models against eager, in the fresh venv ------------------------------


def check_installed(names: list[str]) -> dict[str, dict[str, str]]:
    """Each model of the installed wheel against its eager case, on every sample the build had."""
    import importlib

    cases = importlib.import_module(f"{PACKAGE}.cases")
    compiled = importlib.import_module(f"{PACKAGE}.compiled")
    results = {}
    for name in names:
        try:
            loaded = compiled.load(name)
        except Exception as exc:
            results[name] = {"result": "load failed", "detail": short(exc)}
            continue
        try:
            for sample in cases.samples(name):
                for values in (sample, with_other_values(sample)):
                    if types := run_and_compare(cases.model(name), loaded, values):
                        raise AssertionError("; ".join(types))
        except AssertionError as exc:
            results[name] = {"result": "mismatch", "detail": short(exc)}
        except Exception as exc:
            results[name] = {"result": "run failed", "detail": short(exc)}
        else:
            results[name] = {"result": "ok", "detail": ""}
    return results


# -- the driver ---------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    raw: str = ""
    raw_detail: str = ""
    hatch: str = ""
    hatch_detail: str = ""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_project(root: Path, names: list[str], all_names: list[str], torch_series: str) -> Path:
    """The project: package ``export_cases`` with ``cases.py``, one model per name in ``names``."""
    if root.exists():
        shutil.rmtree(root)
    package = root / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "cases.py").write_text(CASES_MODULE.format(names=all_names), encoding="utf-8")
    text = PYPROJECT.format(torch_series=torch_series, package=PACKAGE)
    text += "".join(MODEL_TABLE.format(name=name, package=PACKAGE) for name in names)
    (root / "pyproject.toml").write_text(text, encoding="utf-8")
    return root


def child_env(work: Path) -> dict[str, str]:
    """The environment of every process the script starts: caches of its own, nothing of this checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")
    env["HATCH_AOTI_CACHE_DIR"] = str(work / "hatch-aoti-cache")  # nothing compiled by other builds
    return env


def run_raw(name: str, project: Path, work: Path, timeout: float) -> tuple[str, str]:
    out = work / "raw" / name
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-case", name, "--project", str(project)]
    cmd += ["--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(work), cwd=out, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timed out", f"after {timeout:.0f}s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        found = json.loads(lines[-1])
        return found["result"], found["detail"]
    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    tail = " ".join(proc.stderr.strip().splitlines()[-1:])[:200]
    return "crashed", f"{how}: {tail}"


#: What a failed build says of each model that failed, and of a model whose settings or inputs are wrong.
FAILED = re.compile(r"model '(\w+)' \([^)]*\) failed at (\w+): (.*)")
PROBLEM = re.compile(r"\.models\.(\w+)[.:\s]\S*:? (.*)")
DOING = re.compile(r"(?:hatch-aoti: )?(.*while \w+ model '(\w+)'[^;]*)")


def failed_models(output: str, names: list[str]) -> dict[str, str]:
    """The models a failed build names, each with why; every model where the build names none."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        line = line.strip().removeprefix("- ")
        if (failed := FAILED.search(line)) and failed[1] in names:
            found.setdefault(failed[1], f"failed at {failed[2]}: {failed[3]}"[:200])
        elif (problem := PROBLEM.search(line)) and problem[1] in names:
            found.setdefault(problem[1], f"refused: {problem[2]}"[:200])
        elif (doing := DOING.search(line)) and doing[2] in names:
            found.setdefault(doing[2], doing[1][:200])
    return found or {name: "the build failed and named no model" for name in names}


def build(project: Path, out: Path, env: dict[str, str], isolated: bool) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "build", "--wheel", "-o", str(out), str(project)]
    if not isolated:
        cmd.insert(4, "--no-isolation")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=project)


def fresh_venv(root: Path, torch_spec: str) -> Path:
    """A venv with torch (and nothing of hatch-aoti): what the wheel's users have."""
    venv.EnvBuilder(with_pip=True, clear=True).create(root)
    python = root / "bin" / "python"
    pip(python, torch_spec)
    return python


def pip(python: Path, *args: str) -> None:
    """``pip install`` into ``python``'s environment; its output shown only if it fails."""
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"pip install {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def hatch_aoti_wheelhouse(work: Path) -> Path:
    """A wheel of this checkout, for isolated builds (``PIP_FIND_LINKS``)."""
    out = work / "wheelhouse"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
    )
    return out


def check_with_hatch_aoti(rows: dict[str, Row], names: list[str], work: Path, args: argparse.Namespace) -> None:
    """Build the wheel of ``names``; the models a build fails are left out of the next (the others come
    from the compile cache) until one builds; then install it and check each model against eager."""
    import torch

    series = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    env = child_env(work)
    if args.isolated:
        links = [str(hatch_aoti_wheelhouse(work)), *filter(None, env.get("PIP_FIND_LINKS", "").split())]
        env["PIP_FIND_LINKS"] = " ".join(links)
    left = list(names)
    wheel = None
    while left:
        project = write_project(work / "project", left, names, series)
        dist = work / "dist"
        shutil.rmtree(dist, ignore_errors=True)
        log(f"building {len(left)} model(s) with hatch-aoti")
        start = time.perf_counter()
        proc = build(project, dist, env, args.isolated)
        log(f"  build {'failed' if proc.returncode else 'passed'} in {time.perf_counter() - start:.0f}s")
        (work / "build.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
        if proc.returncode == 0:
            wheel = next(dist.glob("*.whl"))
            break
        for name, why in failed_models(proc.stdout + proc.stderr, left).items():
            rows[name].hatch, rows[name].hatch_detail = "build failed", why
            left.remove(name)
    if wheel is None:
        return
    log("installing the wheel into a fresh venv with torch")
    python = fresh_venv(work / "venv", args.torch)
    pip(python, "--no-deps", str(wheel))
    probe = f"import importlib.util as u; assert u.find_spec('hatch_aoti') is None; import {PACKAGE}"
    subprocess.run([str(python), "-c", probe], check=True, env=env, cwd=work)
    cmd = [str(python), str(Path(__file__).resolve()), "--check-installed", ",".join(left)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        for name in left:
            rows[name].hatch, rows[name].hatch_detail = "check crashed", proc.stderr.strip()[-200:]
        return
    for name, found in json.loads(lines[-1]).items():
        rows[name].hatch, rows[name].hatch_detail = found["result"], found["detail"]


def print_table(rows: list[Row]) -> None:
    width = max(len("case"), *(len(r.case) for r in rows))
    raw_width = max(len("raw AOTInductor"), *(len(r.raw) for r in rows))
    print(f"{'case':<{width}}  {'raw AOTInductor':<{raw_width}}  hatch-aoti")
    print(f"{'-' * width}  {'-' * raw_width}  {'-' * 10}")
    for row in rows:
        hatch = row.hatch or "-"
        print(f"{row.case:<{width}}  {row.raw:<{raw_width}}  {hatch}")
    notes = [r for r in rows if r.raw_detail or r.hatch_detail]
    if notes:
        print()
        for row in notes:
            if row.raw_detail:
                print(f"{row.case}: raw: {row.raw_detail}")
            if row.hatch_detail:
                print(f"{row.case}: hatch-aoti: {row.hatch_detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--cases", help="comma-separated case names (default: every case)")
    parser.add_argument("--work", type=Path, help="working directory (default: a temporary one, removed at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds for each raw AOTInductor case")
    parser.add_argument(
        "--isolated", action="store_true", help="build in isolation, hatch-aoti from a wheel of this checkout"
    )
    parser.add_argument(
        "--every-case", action="store_true", help="also build the cases raw AOTInductor fails on (not counted)"
    )
    parser.add_argument("--torch", help="the torch the fresh venv gets (default: this interpreter's release)")
    parser.add_argument("--raw-case", help=argparse.SUPPRESS)
    parser.add_argument("--project", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--check-installed", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.raw_case:
        print(json.dumps(raw_case(args.project, args.raw_case, args.out)))
        return 0
    if args.check_installed:
        print(json.dumps(check_installed(args.check_installed.split(","))))
        return 0

    import torch
    from torch._export.db.examples import all_examples

    all_names = sorted(all_examples())
    names = args.cases.split(",") if args.cases else all_names
    unknown = sorted(set(names) - set(all_names))
    if unknown:
        parser.error(f"unknown cases: {', '.join(unknown)}; known: {', '.join(all_names)}")
    args.torch = args.torch or f"torch=={torch.__version__.split('+')[0]}"
    work = args.work or Path(tempfile.mkdtemp(prefix="export-examples-"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        project = write_project(work / "raw-project", [], all_names, "0.0")
        rows = {name: Row(name) for name in names}
        for k, name in enumerate(names, start=1):
            case_start = time.perf_counter()
            rows[name].raw, rows[name].raw_detail = run_raw(name, project, work, args.timeout)
            seconds = time.perf_counter() - case_start
            log(f"[{k}/{len(names)}] {name}: raw AOTInductor: {rows[name].raw} ({seconds:.0f}s)")
        passing = [name for name in names if rows[name].raw in ("ok", RAW_TYPES)]
        built = names if args.every_case else passing
        if built:
            check_with_hatch_aoti(rows, built, work, args)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            log(f"kept {work}")
    print_table(list(rows.values()))
    broken = [name for name in passing if rows[name].hatch != "ok"]
    raw_ok = len(passing)
    print(
        f"\n{len(names)} cases: raw AOTInductor compiles {raw_ok}; hatch-aoti builds and matches eager on "
        f"{raw_ok - len(broken)} of them; {len(broken)} fail with hatch-aoti"
        + (f" ({', '.join(broken)})" if broken else "")
        + f"; {time.perf_counter() - start:.0f}s"
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
