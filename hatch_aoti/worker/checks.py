"""Check every model before anything is exported: factory, module, settings, example inputs.

Runs in the coordinator (it imports torch and the project's code). Each problem is
reported against the TOML key it comes from, and all models are checked before the
build stops, so one build lists everything that is wrong.
"""

from __future__ import annotations

import inspect
import pkgutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hatch_aoti.settings.reader import did_you_mean
from hatch_aoti.settings.spec import ModelSpec

if TYPE_CHECKING:
    from hatch_aoti.worker.inputs import Planned

Problem = tuple[str, str]


@dataclass
class Prepared:
    """A model that passed its checks: its module, input plan and Inductor settings."""

    spec: ModelSpec
    module: Any
    plan: Any
    """An :class:`hatch_aoti.worker.inputs.InputPlan`."""
    user_configs: dict[str, Any] = field(default_factory=dict)
    """The model's ``inductor-configs`` with nested tables flattened to dotted names."""
    mutated: frozenset[str] = frozenset()
    """Key paths (``[0][0]``: the first positional input) of the inputs the eager model writes into."""
    replan: Callable[[ModelSpec], Any] | None = None
    """The plan again, for the spec with other ``dynamic`` entries (the rules export suggests)."""
    signature: list[dict[str, Any]] = field(default_factory=list)
    """``forward``'s parameters (:func:`signature_record`): the loader binds calls to them."""
    calibration: list[Any] = field(default_factory=list)
    """``int8``: the ``(args, kwargs)`` samples ``calibration`` returned, checked like example inputs."""


def short_exception(exc: BaseException) -> str:
    """The exception line, plus where in user code it came from (not our frames)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "hatch_aoti" not in f.filename]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def check_model(spec: ModelSpec, problems: list[Problem]) -> Prepared | None:
    """The model ready to export, or ``None`` with its problems added."""
    import torch

    path = spec.path
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(
            (
                f"{path}.device",
                f"is {spec.device!r}, but torch {torch.__version__} on this build machine sees no CUDA device",
            )
        )
        return None
    configs = inductor_settings(spec.inductor_configs, f"{path}.inductor-configs", problems)
    module = factory_module(spec, problems)
    if module is None or configs is None:
        return None
    inputs_key = "example-inputs" if spec.example_inputs else "inputs"
    signature = inspect.signature(module.forward)
    params = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    planned = _planned(spec, params, problems)
    if planned is None:
        return None
    label, (args, kwargs) = planned.export_label, planned.plan.export_sample
    forward = f"{type(module).__name__}.forward"
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        subject = "do not match" if label is None else f"{label} does not match"
        problems.append((f"{path}.{inputs_key}", f"{subject} {forward}{signature}: {exc}"))
        return None
    failure, mutated = _dry_run(module, args, kwargs)
    if failure is not None:
        problems.append(
            (
                f"{path}.{inputs_key}",
                f"{forward} failed on {label or 'the declared inputs'}, called "
                f"with {describe_call(bound.arguments)}: {failure}{_tuple_hint(bound.arguments)}",
            )
        )
        return None
    calibration = _calibration(spec, module, problems)
    if calibration is None:
        return None
    record = signature_record(signature)
    return Prepared(spec, module, planned.plan, configs, mutated, planned.replan, record, calibration)


def _calibration(spec: ModelSpec, module: Any, problems: list[Problem]) -> list[Any] | None:
    """The samples ``calibration`` returns, each run through the eager model once; ``None`` with the problem."""
    from hatch_aoti.worker.inputs import InputError, normalise_samples

    if spec.calibration is None:
        return []
    path = f"{spec.path}.calibration"
    called, returned = _call(spec.calibration, path, problems)
    if not called:
        return None
    try:
        samples = normalise_samples(returned)
    except InputError as exc:
        problems.append((path, str(exc).replace("example-inputs", "calibration")))
        return None
    for index, (args, kwargs) in enumerate(samples):
        failure, _ = _dry_run(module, args, kwargs)
        if failure is not None:
            problems.append((path, f"the model failed on sample {index}: {failure}"))
            return None
    return samples


def signature_record(signature: inspect.Signature) -> list[dict[str, Any]]:
    """Each parameter's name, kind and default (where it is None, a bool, a number or a string): the
    loader binds a call to them, so that a call eager takes (an argument by name, a default left out)
    reaches the compiled model in the layout it was exported with."""
    record = []
    for p in signature.parameters.values():
        item: dict[str, Any] = {"name": p.name, "kind": p.kind.name}
        if p.default is not p.empty and (p.default is None or type(p.default) in (bool, int, float, str)):
            item["default"] = p.default
        elif p.default is not p.empty:
            item["opaque_default"] = True  # one the manifest cannot hold: a call must pass the argument
        record.append(item)
    return record


def factory_module(spec: ModelSpec, problems: list[Problem]) -> Any:
    """The model's module as its factory builds it, on its device, in eval mode; ``None`` with the problem."""
    import torch

    path = f"{spec.path}.factory"
    called, module = _call(spec.factory, path, problems)
    if not called:
        return None
    if not isinstance(module, torch.nn.Module):
        problems.append((path, f"{spec.factory!r} returned {type(module).__name__}, not a torch.nn.Module"))
        return None
    try:
        return module.to(spec.device).eval()
    except Exception as exc:
        problems.append((f"{spec.path}.device", f"moving the model to {spec.device!r} failed: {short_exception(exc)}"))
        return None


def _call(entry_point: str, path: str, problems: list[Problem]) -> tuple[bool, Any]:
    """Import ``module:attr`` and call it: (True, what it returned), or (False, None) with the problem."""
    try:
        target = pkgutil.resolve_name(entry_point)
    except Exception as exc:
        problems.append((path, f"cannot import {entry_point!r}: {short_exception(exc)}"))
        return False, None
    if not callable(target):
        problems.append((path, f"{entry_point!r} is a {type(target).__name__}, not a callable"))
        return False, None
    try:
        return True, target()
    except Exception as exc:
        problems.append((path, f"calling {entry_point!r} failed: {short_exception(exc)}"))
        return False, None


def _planned(spec: ModelSpec, params: list[str], problems: list[Problem]) -> Planned | None:
    """The model's input plan, from its declared inputs or from what its ``example-inputs`` returns
    (called here, once); ``None`` with the problem."""
    from hatch_aoti.worker import inputs

    returned = None
    if spec.example_inputs is not None:
        called, returned = _call(spec.example_inputs, f"{spec.path}.example-inputs", problems)
        if not called:
            return None
    try:
        return inputs.plan_model(spec, params, returned)
    except inputs.InputError as exc:
        problems.append((f"{spec.path}.{exc.key}", str(exc)))
    except Exception as exc:
        problems.append((f"{spec.path}.{'example-inputs' if spec.example_inputs else 'inputs'}", short_exception(exc)))
    return None


def _dry_run(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, frozenset[str]]:
    """Run the eager model once on a copy of the sample: inputs it cannot take fail here, with the user's
    own error; the inputs it writes into (their version counters move) are named by key path."""
    import torch
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    copies = [value.clone() if isinstance(value, torch.Tensor) else value for _, value in leaves]
    versions = [value._version if isinstance(value, torch.Tensor) else None for value in copies]
    call_args, call_kwargs = pytree.tree_unflatten(copies, spec)
    try:
        with torch.no_grad():
            module(*call_args, **call_kwargs)
    except Exception as exc:
        return short_exception(exc), frozenset()
    return None, frozenset(
        pytree.keystr(path)
        for (path, _), value, version in zip(leaves, copies, versions)
        if version is not None and value._version != version
    )


def describe_call(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{name}={_kind(value)}" for name, value in arguments.items())


def _kind(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_kind(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} ({inner})"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value)}"
    return f"a {type(value).__name__}"


def _tuple_hint(arguments: dict[str, Any]) -> str:
    if not any(isinstance(v, (tuple, list)) for v in arguments.values()):
        return ""
    return (
        ". A sample is the tuple of forward's positional arguments: for forward(x) return (x,), not "
        '((x,),); for keyword arguments return ((x,), {"mask": m}) '
        "(see docs/configuration.md, Example inputs from code)"
    )


def inductor_settings(configs: dict[str, Any], path: str, problems: list[Problem]) -> dict[str, Any] | None:
    """The model's Inductor settings by dotted name, each checked against this torch's Inductor.

    A bare dotted key in TOML (``aot_inductor.enable_line_tables = true``) makes a nested
    table; it is flattened back here. Unknown names, a name set twice (dotted and in its table)
    and values of another type than torch's default are refused before anything compiles:
    Inductor would take a string ``"false"`` as true.
    """
    import torch._inductor.config as inductor_config

    out: dict[str, Any] = {}
    ok = _flat_settings(configs, "", inductor_config.get_config_copy(), path, problems, out)
    return out if ok else None


def _flat_settings(
    configs: dict[str, Any],
    prefix: str,
    defaults: dict[str, Any],
    path: str,
    problems: list[Problem],
    out: dict[str, Any],
) -> bool:
    import torch

    ok = True
    for key, value in configs.items():
        name = f"{prefix}{key}"
        if name in defaults:
            problem = "is set twice, as a dotted name and in its table" if name in out else None
            problem = problem or _value_problem(defaults[name], value)
            if problem:
                problems.append((f"{path}.{name}", problem))
                ok = False
            out[name] = value
        elif isinstance(value, dict) and any(k.startswith(f"{name}.") for k in defaults):
            ok = _flat_settings(value, f"{name}.", defaults, path, problems, out) and ok
        else:
            hint = did_you_mean(name, defaults)
            problems.append((f"{path}.{name}", f"is not an Inductor setting of torch {torch.__version__}{hint}"))
            ok = False
    return ok


def _value_problem(default: Any, value: Any) -> str | None:
    """Why ``value`` cannot stand for an Inductor setting whose default is ``default`` (None: it can;
    settings whose default is None, a list or a table take other types, unchecked)."""
    kinds = ((bool, (bool,), "true or false"), (int, (int,), "an integer"), (float, (int, float), "a number"))
    for kind, allowed, wanted in (*kinds, (str, (str,), "a string")):
        if isinstance(default, kind):
            if type(value) in allowed:
                return None
            return f"must be {wanted}, as torch's default ({default!r}) is; not {value!r}"
    return None
