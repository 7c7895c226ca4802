"""Parse the ``aoti`` hook table into typed settings.

Everything here is pure Python (no torch), so a bad ``pyproject.toml`` is reported in
milliseconds, before any worker starts. Every problem is collected with its full TOML
path and reported together: fixing one typo per build would be a miserable loop when
each build costs a compile.
"""

from __future__ import annotations

import difflib
import keyword
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

HOOK_PATH = "tool.hatch.build.targets.wheel.hooks.aoti"

#: Keys hatchling itself reads from every hook table; they are not ours to validate.
RESERVED_KEYS = frozenset(
    {"dependencies", "require-runtime-dependencies", "require-runtime-features", "enable-by-default"}
)

#: torch dtypes by the names users write, mapped to the ``torch`` attribute.
DTYPES: dict[str, str] = {
    "float32": "float32", "float": "float32",
    "float64": "float64", "double": "float64",
    "float16": "float16", "half": "float16",
    "bfloat16": "bfloat16",
    "complex64": "complex64", "cfloat": "complex64",
    "complex128": "complex128", "cdouble": "complex128",
    "int8": "int8", "uint8": "uint8",
    "int16": "int16", "short": "int16",
    "int32": "int32", "int": "int32",
    "int64": "int64", "long": "int64",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "bool": "bool",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}  # fmt: skip

_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(Exception):
    """All configuration problems of one build, each prefixed with its TOML path."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = [f"  - {path}: {message}" for path, message in problems]
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"hatch-aoti found {len(problems)} {noun} in pyproject.toml:\n" + "\n".join(lines))


@dataclass
class Problems:
    """Collects ``(toml path, message)`` pairs instead of raising on the first one."""

    items: list[tuple[str, str]] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)


@dataclass(frozen=True)
class TensorSpec:
    """One example input declared in TOML rather than built by code."""

    shape: tuple[int | str, ...]
    """Sizes; a string names a dimension that may vary (see ``dynamic``)."""
    dtype: str
    """A torch dtype name (``float32``, ``int64``, ``bool``, ...), already canonical."""
    device: str | None = None
    """Device of this input; defaults to the model's device."""
    low: float | None = None
    """Lower bound of generated values (inclusive); keeps token ids inside a vocabulary."""
    high: float | None = None
    """Upper bound of generated values (exclusive for integer dtypes)."""


@dataclass(frozen=True)
class DimSpec:
    """Bounds of a named dimension; ``None`` leaves that side to torch.export."""

    min: int | None = None
    max: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """One ``models.<name>`` table, validated."""

    name: str
    factory: str
    """``module:attr`` of a callable returning an ``nn.Module`` with its weights loaded."""
    inputs: tuple[TensorSpec, ...] | None
    """Positional example inputs declared in TOML, or ``None`` when ``example-inputs`` is used."""
    kwargs: dict[str, TensorSpec]
    """Keyword example inputs declared in TOML."""
    example_inputs: str | None
    """``module:attr`` of a callable returning samples, the code alternative to ``inputs``."""
    dynamic: dict[str, DimSpec]
    """Bounds of named dimensions."""
    device: str = "cpu"
    inductor_configs: dict[str, Any] = field(default_factory=dict)
    """Passed through to ``aoti_compile_and_package(inductor_configs=...)``."""
    rtol: float | None = None
    """Relative tolerance of the build-time check; ``None`` picks one by output dtype."""
    atol: float | None = None
    """Absolute tolerance of the build-time check; ``None`` picks one by output dtype."""
    verify: bool = True
    """Compare compiled outputs with eager ones at build time."""
    cpu_target: str = "native"
    """Instruction-set baseline of CPU code (resolved: the model's, the hook's, or the default)."""

    @property
    def path(self) -> str:
        return f"{HOOK_PATH}.models.{self.name}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe form for the worker process."""
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSpec:
        data = dict(data)
        if data["inputs"] is not None:
            data["inputs"] = tuple(_tensor_from_json(t) for t in data["inputs"])
        data["kwargs"] = {k: _tensor_from_json(v) for k, v in data["kwargs"].items()}
        data["dynamic"] = {k: DimSpec(**v) for k, v in data["dynamic"].items()}
        return cls(**data)


def _tensor_from_json(data: dict[str, Any]) -> TensorSpec:
    return TensorSpec(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class HookSettings:
    """The whole ``[tool.hatch.build.targets.wheel.hooks.aoti]`` table, validated."""

    models: tuple[ModelSpec, ...]
    package: str | None = None
    """Package that receives the artifacts and the loader; ``None``: the wheel's only one."""
    loader: str = "compiled"
    """Name of the generated loader module inside ``package``."""
    torch_requirement: str | None = None
    """``Requires-Dist`` for torch; ``None``: the release series used to build."""
    cpu_target: str | None = None
    """Default ``cpu-target`` of the models; ``None``: portable baseline of the build machine."""


MODEL_KEYS = (
    "factory", "inputs", "kwargs", "example-inputs", "dynamic", "device",
    "inductor-configs", "rtol", "atol", "verify", "cpu-target",
)  # fmt: skip
HOOK_KEYS = ("package", "loader", "torch-requirement", "cpu-target", "models")
TENSOR_KEYS = ("shape", "dtype", "device", "low", "high")
DIM_KEYS = ("min", "max")


def _unknown_keys(table: dict[str, Any], allowed: tuple[str, ...], path: str, problems: Problems) -> None:
    for key in table:
        if key in allowed:
            continue
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else f"; known keys: {', '.join(allowed)}"
        problems.add(f"{path}.{key}", f"unknown key{hint}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_tensor(raw: Any, path: str, problems: Problems) -> TensorSpec | None:
    if not isinstance(raw, dict):
        problems.add(path, "must be a table like { shape = [4, 128], dtype = \"float32\" }")
        return None
    _unknown_keys(raw, TENSOR_KEYS, path, problems)
    ok = True
    shape = raw.get("shape")
    if shape is None:
        problems.add(f"{path}.shape", "is required")
        ok = False
    elif not isinstance(shape, list):
        problems.add(f"{path}.shape", "must be an array of sizes and dimension names")
        ok = False
    else:
        for i, dim in enumerate(shape):
            if _is_int(dim) and dim >= 0:
                continue
            if isinstance(dim, str) and _NAME.match(dim):
                continue
            problems.add(f"{path}.shape[{i}]", f"must be a size >= 0 or a dimension name, not {dim!r}")
            ok = False
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        close = difflib.get_close_matches(str(dtype), DTYPES, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else f"; known: {', '.join(sorted(set(DTYPES.values())))}"
        problems.add(f"{path}.dtype", f"unknown dtype {dtype!r}{hint}")
        ok = False
    device = raw.get("device")
    if device is not None and not (isinstance(device, str) and _DEVICE.match(device)):
        problems.add(f"{path}.device", f"must be \"cpu\", \"cuda\" or \"cuda:N\", not {device!r}")
        ok = False
    bounds = {}
    for key in ("low", "high"):
        value = raw.get(key)
        if value is not None and not _is_number(value):
            problems.add(f"{path}.{key}", f"must be a number, not {value!r}")
            ok = False
        bounds[key] = value
    if _is_number(bounds["low"]) and _is_number(bounds["high"]) and bounds["low"] >= bounds["high"]:
        problems.add(path, f"`low` ({bounds['low']}) must be below `high` ({bounds['high']})")
        ok = False
    if not ok:
        return None
    return TensorSpec(tuple(shape), DTYPES[dtype], device, bounds["low"], bounds["high"])


def _parse_entry_point(raw: Any, path: str, problems: Problems) -> str | None:
    if not isinstance(raw, str) or not _ENTRY_POINT.match(raw):
        problems.add(path, f'must be a string "module:attr" (e.g. "my_pkg.models:build"), not {raw!r}')
        return None
    return raw


def _parse_cpu_target(raw: Any, path: str, problems: Problems, machine: str) -> str | None:
    from hatch_aoti.cpu_targets import CHOICES, TARGETS

    if raw is None:
        return None
    if raw not in CHOICES:
        close = difflib.get_close_matches(str(raw), CHOICES, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        problems.add(path, f"unknown CPU target {raw!r}{hint}; choose from {', '.join(CHOICES)}")
        return None
    if raw in TARGETS and TARGETS[raw].arch != machine:
        problems.add(path, f"{raw!r} is for {TARGETS[raw].arch} machines; this build machine is {machine}")
        return None
    return str(raw)


def _parse_model(
    name: str, raw: Any, problems: Problems, default_cpu_target: str, machine: str
) -> ModelSpec | None:
    path = f"{HOOK_PATH}.models.{name}"
    if not _NAME.match(name) or keyword.iskeyword(name):
        problems.add(path, "model names must be Python identifiers (letters, digits, `_`)")
    if not isinstance(raw, dict):
        problems.add(path, "must be a table")
        return None
    start = len(problems.items)
    _unknown_keys(raw, MODEL_KEYS, path, problems)

    factory = None
    if "factory" not in raw:
        problems.add(f"{path}.factory", 'is required: "module:attr" of a callable returning an nn.Module')
    else:
        factory = _parse_entry_point(raw["factory"], f"{path}.factory", problems)

    inputs: tuple[TensorSpec, ...] | None = None
    example_inputs = None
    if "inputs" in raw and "example-inputs" in raw:
        problems.add(path, "give either `inputs` or `example-inputs`, not both")
    elif "example-inputs" in raw:
        example_inputs = _parse_entry_point(raw["example-inputs"], f"{path}.example-inputs", problems)
        if "kwargs" in raw:
            problems.add(f"{path}.kwargs", "cannot be combined with `example-inputs`; return kwargs from it")
    elif "inputs" in raw:
        raw_inputs = raw["inputs"]
        if not isinstance(raw_inputs, list):
            problems.add(f"{path}.inputs", "must be an array of tables like { shape = [4, 128], dtype = \"float32\" }")
        else:
            parsed = [_parse_tensor(t, f"{path}.inputs[{i}]", problems) for i, t in enumerate(raw_inputs)]
            inputs = tuple(t for t in parsed if t is not None)
    elif "kwargs" not in raw:
        problems.add(path, "needs example inputs: `inputs = [{ shape = [...], dtype = \"...\" }]` or `example-inputs`")

    kwargs: dict[str, TensorSpec] = {}
    raw_kwargs = raw.get("kwargs", {})
    if not isinstance(raw_kwargs, dict):
        problems.add(f"{path}.kwargs", "must be a table of name = { shape = [...], dtype = \"...\" }")
    elif example_inputs is None:
        for key, value in raw_kwargs.items():
            spec = _parse_tensor(value, f"{path}.kwargs.{key}", problems)
            if spec is not None:
                kwargs[key] = spec
        if inputs is None and "inputs" not in raw:
            inputs = ()

    dynamic: dict[str, DimSpec] = {}
    raw_dynamic = raw.get("dynamic", {})
    if not isinstance(raw_dynamic, dict):
        problems.add(f"{path}.dynamic", "must be a table of name = { min = ..., max = ... }")
    else:
        for dim_name, bounds in raw_dynamic.items():
            dim_path = f"{path}.dynamic.{dim_name}"
            if not isinstance(bounds, dict):
                problems.add(dim_path, "must be a table like { min = 1, max = 512 }")
                continue
            _unknown_keys(bounds, DIM_KEYS, dim_path, problems)
            lo, hi = bounds.get("min"), bounds.get("max")
            bad = False
            for key, value in (("min", lo), ("max", hi)):
                if value is not None and not (_is_int(value) and value >= 0):
                    problems.add(f"{dim_path}.{key}", f"must be an integer >= 0, not {value!r}")
                    bad = True
            if not bad and lo is not None and hi is not None and lo > hi:
                problems.add(dim_path, f"min ({lo}) is greater than max ({hi})")
                bad = True
            if not bad:
                dynamic[dim_name] = DimSpec(lo, hi)
        if example_inputs is None:
            used = {d for t in (*(inputs or ()), *kwargs.values()) for d in t.shape if isinstance(d, str)}
            for dim_name in raw_dynamic:
                if dim_name not in used:
                    problems.add(f"{path}.dynamic.{dim_name}", "is not used by any input shape")

    device = raw.get("device", "cpu")
    if not (isinstance(device, str) and _DEVICE.match(device)):
        problems.add(f"{path}.device", f'must be "cpu", "cuda" or "cuda:N", not {device!r}')

    configs = raw.get("inductor-configs", {})
    if not isinstance(configs, dict):
        problems.add(f"{path}.inductor-configs", "must be a table of AOTInductor config names to values")

    tolerances = {}
    for key in ("rtol", "atol"):
        value = raw.get(key)
        if value is not None and not (_is_number(value) and value >= 0):
            problems.add(f"{path}.{key}", f"must be a number >= 0, not {value!r}")
        tolerances[key] = value

    verify = raw.get("verify", True)
    if not isinstance(verify, bool):
        problems.add(f"{path}.verify", f"must be true or false, not {verify!r}")

    from hatch_aoti.cpu_targets import NATIVE, OWNED_CONFIGS

    cpu_target = _parse_cpu_target(raw.get("cpu-target"), f"{path}.cpu-target", problems, machine)
    cpu_target = cpu_target or default_cpu_target
    if cpu_target != NATIVE and isinstance(configs, dict):
        for key in OWNED_CONFIGS:
            if key in configs:
                problems.add(f"{path}.inductor-configs.{key}", f"is set by cpu-target {cpu_target!r}; "
                             'use `cpu-target = "native"` to control it yourself')

    if len(problems.items) > start or factory is None:
        return None
    return ModelSpec(
        name=name,
        factory=factory,
        inputs=inputs,
        kwargs=kwargs,
        example_inputs=example_inputs,
        dynamic=dynamic,
        device=device,
        inductor_configs=dict(configs),
        rtol=tolerances["rtol"],
        atol=tolerances["atol"],
        verify=verify,
        cpu_target=cpu_target,
    )


def parse_settings(raw: dict[str, Any], machine: str | None = None) -> HookSettings:
    """Validate the hook table; raise :class:`ConfigError` listing every problem."""
    problems = Problems()
    table = {k: v for k, v in raw.items() if k not in RESERVED_KEYS}
    _unknown_keys(table, HOOK_KEYS, HOOK_PATH, problems)

    package = table.get("package")
    if package is not None and not (isinstance(package, str) and all(_NAME.match(p) for p in package.split("."))):
        problems.add(f"{HOOK_PATH}.package", f"must be an importable package name, not {package!r}")
    loader = table.get("loader", "compiled")
    if not (isinstance(loader, str) and _NAME.match(loader) and not keyword.iskeyword(loader)):
        problems.add(f"{HOOK_PATH}.loader", f"must be a Python module name, not {loader!r}")
    torch_req = table.get("torch-requirement")
    if torch_req is not None:
        from packaging.requirements import InvalidRequirement, Requirement  # not needed in workers

        try:
            if not isinstance(torch_req, str):
                raise InvalidRequirement(repr(torch_req))
            if Requirement(torch_req).name.lower() != "torch":
                problems.add(f"{HOOK_PATH}.torch-requirement", f"must be a requirement on torch, not {torch_req!r}")
        except InvalidRequirement as exc:
            problems.add(f"{HOOK_PATH}.torch-requirement", f"is not a valid requirement: {exc}")

    from hatch_aoti.cpu_targets import default_target

    machine = machine or os.uname().machine
    hook_cpu_target = _parse_cpu_target(table.get("cpu-target"), f"{HOOK_PATH}.cpu-target", problems, machine)
    models: list[ModelSpec] = []
    raw_models = table.get("models")
    if raw_models is None:
        problems.add(f"{HOOK_PATH}.models", "is required: declare at least one [..models.<name>] table")
    elif not isinstance(raw_models, dict) or not raw_models:
        problems.add(f"{HOOK_PATH}.models", "must be a non-empty table of models")
    else:
        for name, model in raw_models.items():
            spec = _parse_model(name, model, problems, hook_cpu_target or default_target(machine), machine)
            if spec is not None:
                models.append(spec)

    problems.raise_if_any()
    return HookSettings(
        models=tuple(models),
        package=package,
        loader=loader,
        torch_requirement=torch_req,
        cpu_target=hook_cpu_target,
    )
