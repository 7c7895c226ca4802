"""The build worker: import factories, export, compile, verify. Run as ``python -m hatch_aoti.worker JOB``.

It runs in its own process so that torch is never imported into the build backend and
a compiler crash (or a segfault in user code) becomes a build error with a message,
not a dead frontend. It talks to the hook through JSON lines on a pipe whose fd is in
``HATCH_AOTI_EVENT_FD``; the user's own prints go to the log.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from hatch_aoti.config import ModelSpec

EXIT_CONFIG = 3
#: Under the cache root: compiled code of the worker's imports (see ``bytecode.py``).
BYTECODE_DIR = "bytecode"
EXIT_MODEL = 4


class _Events:
    def __init__(self, fd: int | None) -> None:
        self._file = os.fdopen(fd, "w", buffering=1, encoding="utf-8") if fd is not None else None

    def emit(self, event: str, **data: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, **data}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _resolve(entry_point: str) -> Any:
    module_name, _, attr = entry_point.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _short_exception(exc: BaseException) -> str:
    """The exception line, plus where in user code it came from (not our frames)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "hatch_aoti" not in f.filename]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


class ModelJob:
    """One model on its way through the worker: its spec, then its module and input plan,
    then the CPU target and inductor configs it is keyed and compiled with."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.module: Any = None
        self.plan: Any = None
        self.target: Any = None
        self.configs: dict[str, Any] = {}


def check(jobs: list[ModelJob], problems: list[tuple[str, str]]) -> None:
    """Everything that can be wrong before compiling: imports, modules, inputs vs signature."""
    import torch

    from hatch_aoti import inputs as inputs_mod

    for job in jobs:
        spec = job.spec
        path = spec.path
        if spec.device.startswith("cuda") and not torch.cuda.is_available():
            problems.append((f"{path}.device", f"is {spec.device!r}, but torch {torch.__version__} on this "
                             "build machine sees no CUDA device"))
            continue
        try:
            factory = _resolve(spec.factory)
        except Exception as exc:  # noqa: BLE001 - any import error is the user's to see
            problems.append((f"{path}.factory", f"cannot import {spec.factory!r}: {_short_exception(exc)}"))
            continue
        if not callable(factory):
            problems.append((f"{path}.factory", f"{spec.factory!r} is a {type(factory).__name__}, not a callable"))
            continue
        try:
            module = factory()
        except Exception as exc:  # noqa: BLE001
            problems.append((f"{path}.factory", f"calling {spec.factory!r} failed: {_short_exception(exc)}"))
            continue
        if not isinstance(module, torch.nn.Module):
            problems.append((f"{path}.factory", f"{spec.factory!r} returned {type(module).__name__}, "
                             "not a torch.nn.Module"))
            continue
        module = module.to(spec.device).eval()
        signature = inspect.signature(module.forward)
        params = [
            p.name for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        try:
            if spec.example_inputs is not None:
                try:
                    make = _resolve(spec.example_inputs)
                except Exception as exc:  # noqa: BLE001
                    raise inputs_mod.InputError("example-inputs", f"cannot import {spec.example_inputs!r}: "
                                                f"{_short_exception(exc)}") from None
                if not callable(make):
                    raise inputs_mod.InputError("example-inputs", f"{spec.example_inputs!r} is not callable")
                samples = inputs_mod.normalise_samples(make())
                plan = inputs_mod.plan_from_samples(spec, samples, params)
            else:
                plan = inputs_mod.plan_declared(spec, params)
        except inputs_mod.InputError as exc:
            problems.append((f"{path}.{exc.key}", str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001
            key = "example-inputs" if spec.example_inputs else "inputs"
            problems.append((f"{path}.{key}", _short_exception(exc)))
            continue
        args, kwargs = plan.export_sample
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            key = "example-inputs" if spec.example_inputs else "inputs"
            problems.append((f"{path}.{key}", f"do not match {type(module).__name__}.forward"
                             f"{signature}: {exc}"))
            continue
        job.module, job.plan = module, plan


def export_one(job: ModelJob) -> Any:
    import torch

    args, kwargs = job.plan.export_sample
    try:
        return torch.export.export(job.module, args, kwargs, dynamic_shapes=job.plan.dynamic_shapes)
    except Exception as exc:  # noqa: BLE001
        raise ModelFailure(job.spec.name, "export", f"torch.export failed: {type(exc).__name__}: {exc}") from None


#: Where hatch-aoti departs from Inductor's defaults, for code that ships in wheels.
#: Line tables (``-g1``) triple the size of a small model's library and carry build
#: paths; release builds of torch itself ship without them. ``inductor-configs`` can
#: turn them back on.
WHEEL_DEFAULTS: dict[str, Any] = {"aot_inductor.enable_line_tables": False}


def inductor_configs(spec: ModelSpec, target: Any) -> dict[str, Any]:
    """The configs a model compiles with: wheel defaults, then its CPU target, then the user's."""
    import torch._inductor.config

    known = {k: v for k, v in WHEEL_DEFAULTS.items() if _has_config(torch._inductor.config, k)}
    # The target applies to CUDA models too: their wrapper is CPU code built with -march.
    return {**known, **target.inductor_configs, **spec.inductor_configs}


def _has_config(module: Any, dotted: str) -> bool:
    """Whether this torch's Inductor has the setting (older releases lack some)."""
    obj = module
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def compile_one(job: ModelJob, exported: Any, pt2_dir: Path, artifact_root: Path) -> dict[str, Any]:
    import torch._inductor

    from hatch_aoti.artifacts import unpack_pt2

    spec, plan, target, configs = job.spec, job.plan, job.target, job.configs
    pt2 = pt2_dir / f"{spec.name}.pt2"
    try:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(pt2), inductor_configs=dict(configs))
    except Exception as exc:  # noqa: BLE001
        raise ModelFailure(spec.name, "compile", f"AOTInductor failed: {type(exc).__name__}: {exc}") from None
    entry = unpack_pt2(pt2, artifact_root, spec.name)
    pt2.unlink()
    entry["call"] = describe_call(exported, plan.axis_names)
    entry.update(
        device=spec.device,
        inputs=plan.description,
        dynamic={name: {"min": lo, "max": hi} for name, (lo, hi) in plan.dims.items()},
        inductor_configs=dict(configs),
        cpu={"target": target.name, "arch": target.arch, "features": list(target.features)},
    )
    return entry


def describe_call(exported: Any, axis_names: list[dict[int, str]]) -> list[dict[str, Any]]:
    """What each flattened input must be, as the exported program has it.

    The loader checks calls against this (AOTInductor itself does not): dtype, device,
    rank, static sizes, and each dynamic size's range; constants that export baked in
    must be passed unchanged.
    """
    from torch.export.graph_signature import ConstantArgument, InputKind, TensorArgument

    nodes = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    out: list[dict[str, Any]] = []
    tensor_index = 0
    for input_spec in exported.graph_signature.input_specs:
        if input_spec.kind != InputKind.USER_INPUT:
            continue
        arg = input_spec.arg
        if isinstance(arg, ConstantArgument):
            value = arg.value
            plain = value is None or isinstance(value, (bool, int, float, str))
            out.append({"const": value if plain else repr(value), "check_const": plain})
            continue
        if not isinstance(arg, TensorArgument):
            out.append({"const": repr(arg), "check_const": False})
            continue
        fake = nodes[arg.name].meta["val"]
        names = axis_names[tensor_index] if tensor_index < len(axis_names) else {}
        tensor_index += 1
        shape: list[Any] = []
        for axis, size in enumerate(fake.shape):
            if isinstance(size, int):
                shape.append(size)
                continue
            expr = size.node.expr
            bounds = exported.range_constraints.get(expr)
            lo = _finite(bounds.lower) if bounds is not None else None
            hi = _finite(bounds.upper) if bounds is not None else None
            shape.append({"name": names.get(axis, str(expr)), "min": lo or 0, "max": hi})
        out.append({"dtype": str(fake.dtype).removeprefix("torch."), "device": fake.device.type, "shape": shape})
    return out


def _finite(value: Any) -> int | None:
    """An int for a finite sympy bound, ``None`` for torch's (or sympy's) infinities."""
    try:
        return int(value)
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None


class ModelFailure(Exception):
    def __init__(self, model: str, stage: str, message: str) -> None:
        self.model, self.stage = model, stage
        super().__init__(message)


def verify_one(job: ModelJob, loader: Any) -> dict[str, Any]:
    import torch

    from hatch_aoti.verify import compare

    spec = job.spec
    compiled = loader.load(spec.name)
    tried = []
    for label, (args, kwargs) in job.plan.verify_samples:
        shapes = [list(t.shape) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        with torch.no_grad():
            try:
                expected = job.module(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                raise ModelFailure(spec.name, "verify", f"eager model failed on {label} inputs {shapes}: "
                                   f"{_short_exception(exc)}") from None
            try:
                actual = compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                raise ModelFailure(spec.name, "verify", f"compiled model failed on {label} inputs {shapes}: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        result = compare(label, expected, actual, spec.rtol, spec.atol)
        if result.problems:
            raise ModelFailure(spec.name, "verify", f"compiled output differs from eager on {label} inputs "
                               f"{shapes}: " + "; ".join(result.problems))
        tried.append({"inputs": label, "shapes": shapes, "max_abs_err": result.max_abs, "max_rel_err": result.max_rel})
    return {"passed": True, "rtol": spec.rtol, "atol": spec.atol, "tried": tried}


def _import_file(name: str, path: Path) -> Any:
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def preload_torch() -> None:
    """Import torch and its export machinery with the cycle collector paused.

    These imports build a large, long-lived object graph and almost no garbage, yet the
    collector keeps walking it while they run: paused, they take about a fifth less
    time, and on a cached rebuild they are most of the build. Afterwards the imported
    objects are frozen out of later collections, which also helps export and compile.
    User code runs only after this, with the collector back on.
    """
    gc.disable()
    try:
        import torch  # noqa: F401

        with contextlib.suppress(ImportError):  # loaded by torch.export.export's first call anyway
            importlib.import_module("torch.export._trace")
    finally:
        gc.freeze()
        gc.enable()


def run(job: dict[str, Any], emit: Callable[..., None], receive: Callable[[], dict[str, Any]]) -> int:
    """Check every model, then take each from the cache or build the ones the hook assigns.

    The hook answers twice: ``{"go": bool}`` once every worker has checked its models
    (nobody compiles before all models checked out), and, if some models missed the
    cache, ``{"build": [names]}``: the misses this worker compiles itself. The hook may
    hand the others to helper workers, so a cached rebuild runs in one process (torch
    is imported once) while compiles still spread over the machine's cores.
    """
    from hatch_aoti import __version__
    from hatch_aoti.artifacts import ARTIFACT_DIR, write_loader
    from hatch_aoti.cache import CompileCache
    from hatch_aoti.cpu_targets import resolve as resolve_target
    from hatch_aoti.fingerprint import cache_key

    for entry in reversed(job["sys_path"]):
        sys.path.insert(0, entry)
    if job.get("cache"):
        from hatch_aoti.bytecode import install

        install(Path(job["cache"]) / BYTECODE_DIR)
    preload_torch()
    import torch

    jobs = [ModelJob(ModelSpec.from_json(m)) for m in job["models"]]
    problems: list[tuple[str, str]] = []
    check(jobs, problems)
    emit("checked", problems=problems)
    if problems or not receive().get("go"):
        return EXIT_CONFIG if problems else 0

    cache = CompileCache(Path(job["cache"])) if job.get("cache") else None
    stage = Path(job["stage"])
    package_dir = stage / "package"
    artifact_root = package_dir / ARTIFACT_DIR
    pt2_dir = stage / "pt2"
    pt2_dir.mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict[str, Any]] = {}
    keys: dict[str, str] = {}
    manifest = {"hatch_aoti": __version__, "torch": torch.__version__, "models": entries}
    misses: list[tuple[ModelJob, Any]] = []
    try:
        for j in jobs:
            name = j.spec.name
            start = time.perf_counter()
            exported = export_one(j)
            j.target = resolve_target(j.spec.cpu_target)
            j.configs = inductor_configs(j.spec, j.target)
            keys[name] = cache_key(exported, j.spec.to_json(), j.plan.description, j.configs,
                                   j.spec.cpu_target)  # fmt: skip
            record = None
            if cache is not None:
                try:
                    record = cache.lookup(keys[name], artifact_root / name)
                except OSError as exc:  # an unreadable cache is a miss, not a failed build
                    emit("warning", message=f"{name}: could not read the compile cache ({exc})")
            if record is None:
                misses.append((j, exported))
                continue
            entries[name] = record["entry"]
            emit("model_cached", model=name, seconds=time.perf_counter() - start,
                 verification=record["entry"].get("verification"))  # fmt: skip
        emit("planned", misses=[j.spec.name for j, _ in misses])
        if misses:
            assigned = set(receive().get("build", ()))
            for j, _ in misses:
                if j.spec.name not in assigned:
                    del keys[j.spec.name]  # a helper builds it
            misses = [(j, exported) for j, exported in misses if j.spec.name in assigned]
        for j, exported in misses:
            start = time.perf_counter()
            entries[j.spec.name] = compile_one(j, exported, pt2_dir, artifact_root)
            emit("model_compiled", model=j.spec.name, seconds=time.perf_counter() - start)
        write_loader(package_dir, job["loader"], manifest)
        loader = _import_file(f"_hatch_aoti_staged_{job['loader']}", package_dir / f"{job['loader']}.py")
        for j, _ in misses:
            name = j.spec.name
            start = time.perf_counter()
            if j.spec.verify:
                entries[name]["verification"] = report = verify_one(j, loader)
                emit("model_verified", model=name, seconds=time.perf_counter() - start, verification=report)
            else:
                entries[name]["verification"] = {"passed": None, "skipped": "verify = false"}
                emit("model_verified", model=name, verification=entries[name]["verification"])
            if cache is not None:
                try:
                    cache.store(keys[name], artifact_root / name, {"entry": entries[name]})
                except OSError as exc:  # a read-only or full cache must not fail the build
                    emit("warning", message=f"{name}: could not write the compile cache ({exc})")
    except ModelFailure as exc:
        emit("model_error", model=exc.model, stage=exc.stage, message=str(exc))
        return EXIT_MODEL
    write_loader(package_dir, job["loader"], manifest)
    emit("done", torch=torch.__version__, keys=keys)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    fd = os.environ.get("HATCH_AOTI_EVENT_FD")
    events = _Events(int(fd) if fd else None)
    code = run(job, events.emit, _receive)
    events.close()
    return code


def _receive() -> dict[str, Any]:
    """The hook's next answer (a JSON line on stdin); ``{}`` if the hook went away."""
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else {}


def exit_without_teardown(code: int) -> NoReturn:
    """End the worker without finalising the interpreter.

    Tearing down a process that imported torch's export stack takes about half a
    second (module and object teardown), longer than a whole cached model. Nothing is
    lost by skipping it: every result is on disk and every event written by now. Exit
    handlers still run, so torch's compile worker pools and logging shut down as usual.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
