"""The table resolved into model specs: each model's settings against the table's defaults, and the
checks across keys and against the build machine (CPU targets, `optimize = "host"`, backends).

Works on what the reader read and, for the CPU targets, on the raw table, so that every
problem of one build is listed at once.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

from hatch_aoti.settings.constants import HATCH_TABLE, HOST, OPTIMIZE, PORTABLE
from hatch_aoti.settings.cpu_targets import CHOICES, NATIVE, OWNED_CONFIGS, TARGETS, default_target, host_flags
from hatch_aoti.settings.model import ModelTable, Table
from hatch_aoti.settings.reader import Problems, model_path, read_partly
from hatch_aoti.settings.spec import ModelSpec, Settings


def parse_settings(
    raw: Any,
    table: str = HATCH_TABLE,
    machine: str | None = None,
    flags: set[str] | None = None,
    backend_check: Callable[[ModelSpec], list[tuple[str, str]]] | None = None,
) -> Settings:
    """Validate the table; raise :class:`ConfigError` listing every problem.

    ``machine`` and ``flags`` (``os.uname().machine`` and the CPU's feature flags) are
    the build machine's unless given. ``backend_check`` (the front ends pass
    :func:`hatch_aoti.backends.problems`) adds what each model's backend cannot compile.
    """
    problems = Problems()
    parsed: Table | None = read_partly(Table, raw, table, problems)
    machine = machine or os.uname().machine
    default = default_target(machine)
    table_raw = raw if isinstance(raw, dict) else {}
    targets = _target_problems(table_raw, table, machine, host_flags() if flags is None else flags, default, problems)
    if parsed is not None:
        for name, model in parsed.models.items():
            if model.weights == "external" and (model.backend or parsed.backend) != "aoti":
                problems.add(f"{model_path(table, name)}.weights", "`external` weights are for `aoti` models")
            if model.tune and (model.backend or parsed.backend) != "aoti":
                backend = model.backend or parsed.backend
                problems.add(
                    f"{model_path(table, name)}.tune", f"tunes `aoti` models only; this one's backend is {backend!r}"
                )
            _host_problems(name, model, parsed, table, problems)
            _precision_problems(name, model, parsed, table, problems)
    specs = _specs(parsed, targets, table) if parsed is not None else ()
    for path, message in (p for spec in specs for p in (backend_check(spec) if backend_check else ())):
        problems.add(path, message)
    problems.raise_if_any()
    assert parsed is not None
    return Settings(
        models=specs,
        package=parsed.package,
        loader=parsed.loader,
        torch_requirement=parsed.torch_requirement,
        cpu_target=parsed.cpu_target or default,
        table=table,
        weights_dir=parsed.weights_dir,
    )


def _specs(parsed: Table, targets: dict[str, str], table: str) -> tuple[ModelSpec, ...]:
    """The models that read well, resolved against the table's keys that did."""
    return tuple(
        _spec(name, model, targets[name], model.backend or parsed.backend, model_path(table, name), parsed)
        for name, model in parsed.models.items()
    )


def _spec(name: str, model: ModelTable, target: str, backend: str, path: str, parsed: Table) -> ModelSpec:
    return ModelSpec(
        name=name,
        factory=model.factory,
        inputs=model.inputs,
        kwargs=dict(model.kwargs),
        example_inputs=model.example_inputs,
        dynamic=dict(model.dynamic),
        device=model.device,
        inductor_configs=dict(model.inductor_configs),
        rtol=model.rtol,
        atol=model.atol,
        verify=model.verify,
        cpu_target=target,
        backend=backend,
        weights=model.weights,
        path=path,
        tune=(parsed.tune if model.tune is None else model.tune) and backend == "aoti",
        weights_url=model.weights_url,
        optimize=applied_optimize(model.optimize, parsed.optimize),
        precision=_as_tuple(model.precision or parsed.precision),
        calibration=model.calibration,
        accuracy={
            p: {k: v for k, v in (("rel_error", a.rel_error), ("cosine", a.cosine)) if v is not None}
            for p, a in model.accuracy.items()
        },
    )


def _as_tuple(precision: str | tuple[str, ...]) -> tuple[str, ...]:
    return (precision,) if isinstance(precision, str) else tuple(precision)


def _precision_problems(name: str, model: ModelTable, parsed: Table, table: str, problems: Problems) -> None:
    """Lower precisions are for CPU `aoti` models; `calibration` and `accuracy` name precisions it builds."""
    path = model_path(table, name)
    listed = _as_tuple(model.precision or parsed.precision)
    where = f"{path}.precision" if model.precision else path  # the table's: said of this model
    given = "" if model.precision else '; the table\'s `precision` lists them: give this model `precision = "float32"`'
    lower = [p for p in listed if p != "float32"]
    backend = model.backend or parsed.backend
    if lower and backend != "aoti":
        problems.add(
            where, f"{', '.join(lower)} variants are for `aoti` models; this one's backend is {backend!r}{given}"
        )
    elif lower and model.device != "cpu":
        problems.add(where, f"{', '.join(lower)} variants are for CPU models for now, not {model.device}{given}")
    if model.calibration is not None and "int8" not in listed:
        problems.add(f"{path}.calibration", "applies only where `precision` lists `int8`")
    for precision in model.accuracy:
        if precision not in lower:
            problems.add(
                f"{path}.accuracy.{precision}",
                f"applies to a lower precision this model builds ({', '.join(lower) or 'none'}), not {precision!r}",
            )
    if "int8" in listed and importlib.util.find_spec("torchao") is None:
        problems.add(
            f"{path}.precision" if model.precision else f"{table}.precision",
            "`int8` needs torchao at build time (its PT2E quantizer); add `torchao` to `build-system.requires`",
        )


def _host_problems(name: str, model: ModelTable, parsed: Table, table: str, problems: Problems) -> None:
    """`optimize = "host"` is for CPU `aoti` models."""
    if applied_optimize(model.optimize, parsed.optimize) != HOST:
        return
    path = model_path(table, name)
    own = f"{path}.optimize" if model.optimize else None
    portable = '; or set `optimize = "portable"` on this model'
    backend = model.backend or parsed.backend
    if backend != "aoti":
        where = own or (f"{path}.backend" if model.backend else f"{table}.optimize")
        hint = portable if where.endswith(".backend") else ""
        problems.add(where, f'`optimize = "host"` is for `aoti` models, not the {backend!r} backend{hint}')
    elif model.device != "cpu":
        hint = "" if own else portable
        problems.add(own or f"{path}.device", f'`optimize = "host"` is for CPU models, not {model.device}{hint}')


def _target_problems(
    raw: dict[str, Any], table: str, machine: str, flags: set[str], default: str, problems: Problems
) -> dict[str, str]:
    """Each model's CPU target, checked against this machine and the model's own settings.

    Works on the raw table so that these problems are listed beside any others.
    """

    def valid(value: Any) -> str | None:
        return value if isinstance(value, str) and value in CHOICES else None

    table_target = valid(raw.get("cpu-target"))
    if table_target:
        _check_target(table_target, f"{table}.cpu-target", machine, flags, problems)
    models = raw.get("models")
    targets: dict[str, str] = {}
    for name, model in models.items() if isinstance(models, dict) else ():
        if not isinstance(model, dict):
            continue
        path = model_path(table, name)
        own = valid(model.get("cpu-target"))
        if own:
            _check_target(own, f"{path}.cpu-target", machine, flags, problems)
        host = applied_optimize(model.get("optimize"), raw.get("optimize")) == HOST
        # A model's own `host` overrides the table's target; the table's own `host` does not.
        native = host and (model.get("optimize") == HOST or not table_target)
        targets[name] = target = own or (NATIVE if native else table_target or default)
        if host and target != NATIVE:
            problems.add(
                f"{path}.cpu-target" if own else f"{table}.cpu-target",
                f'{target!r} conflicts with `optimize = "host"`, which compiles for the build machine: '
                'drop it or use `cpu-target = "native"`',
            )
        configs = model.get("inductor-configs")
        if target != NATIVE and isinstance(configs, dict):
            for owned in sorted(set(OWNED_CONFIGS) & set(flat_config_names(configs))):
                problems.add(
                    f"{path}.inductor-configs.{owned}",
                    f'is set by cpu-target {target!r}; use `cpu-target = "native"` to control it yourself',
                )
    return targets


def _check_target(name: str, path: str, machine: str, flags: set[str], problems: Problems) -> None:
    """A target runs only on its architecture, and is verified only on a CPU that has its features."""
    if name not in TARGETS:
        return
    target = TARGETS[name]
    if target.arch != machine:
        problems.add(path, f"{name!r} is for {target.arch} machines; this build machine is {machine}")
        return
    missing = [f for f in target.features if f not in flags]
    if flags and missing:
        problems.add(
            path,
            f"{name!r} needs CPU features this build machine lacks ({', '.join(missing)}), so "
            "the compiled code could not be verified here; build on a machine that has them",
        )


def flat_config_names(configs: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted names of Inductor settings, whether written quoted or as nested TOML tables."""
    for name, value in configs.items():
        dotted = f"{prefix}{name}"
        yield dotted
        if isinstance(value, dict) and "." not in str(name):
            yield from flat_config_names(value, f"{dotted}.")


def applied_optimize(own: Any, table: Any) -> str:
    """A model's `optimize`: its own, else the table's (either as written, valid or not)."""
    return own if own in OPTIMIZE else table if table in OPTIMIZE else PORTABLE
