"""The settings tables as written: one dataclass per table, each key with its documentation and its checks.

:mod:`hatch_aoti.settings.reader` reads them; the reference tables of ``docs/configuration.md``
and the JSON schema are generated from the same fields.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hatch_aoti.loader.schema import PRECISIONS
from hatch_aoti.settings.constants import (
    DTYPES,
    INTEGER_DEFAULTS,
    INTEGER_RANGES,
    MAX_SIZE,
    OPTIMIZE,
    PORTABLE,
    WEIGHTS,
    WEIGHTS_URL_SCHEMES,
    parse_rule,
)
from hatch_aoti.settings.cpu_targets import CHOICES
from hatch_aoti.settings.reader import INVALID, NAME, Problems, did_you_mean, is_identifier, key, matches
from hatch_aoti.settings.registry import known

_ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)\Z")
#: What ``_DEVICE`` accepts, as an ECMA-262 pattern for the JSON schema.
DEVICE_PATTERN = "^(cpu|cuda(:[0-9]+)?)$"

# -- value checks --------------------------------------------------------------------------


def _entry_point(value: str, path: str, problems: Problems) -> Any:
    if _ENTRY_POINT.match(value):
        return value
    problems.add(path, f'must be a string "module:attr" (e.g. "my_pkg.models:build"), not {value!r}')
    return INVALID


def _device(value: str, path: str, problems: Problems) -> Any:
    if _DEVICE.match(value):
        return value
    problems.add(path, f'must be "cpu", "cuda" or "cuda:N", not {value!r}')
    return INVALID


def _dtype(value: str, path: str, problems: Problems) -> Any:
    if value in DTYPES:
        return DTYPES[value]
    hint = did_you_mean(value, DTYPES) or f"; known: {', '.join(sorted(set(DTYPES.values())))}"
    problems.add(path, f"unknown dtype {value!r}{hint}")
    return INVALID


def _precision(value: str | tuple[str, ...], path: str, problems: Problems) -> Any:
    """One precision or a non-empty list of distinct ones, kept as a tuple in order of preference."""
    listed = (value,) if isinstance(value, str) else value
    if not listed:
        problems.add(path, f"must name at least one precision: {', '.join(map(repr, PRECISIONS))}")
        return INVALID
    bad = False
    for index, name in enumerate(listed):
        where = path if isinstance(value, str) else f"{path}[{index}]"
        if name not in PRECISIONS:
            hint = did_you_mean(name, PRECISIONS) or f"; one of {', '.join(map(repr, PRECISIONS))}"
            problems.add(where, f"unknown precision {name!r}{hint}")
            bad = True
        elif name in listed[:index]:
            problems.add(where, f"{name!r} is listed twice")
            bad = True
    return INVALID if bad else tuple(listed)


def _shape(value: tuple[Any, ...], path: str, problems: Problems) -> Any:
    ok = True
    for i, dim in enumerate(value):
        if not (matches(int, dim) and dim >= 0) and not (isinstance(dim, str) and NAME.match(dim)):
            problems.add(f"{path}[{i}]", f"must be a size >= 0 or a dimension name, not {dim!r}")
            ok = False
    return value if ok else INVALID


def _at_least_zero(value: float, path: str, problems: Problems) -> Any:
    if value >= 0:
        return value
    problems.add(path, f"must be >= 0, not {value!r}")
    return INVALID


def _cpu_target(value: str, path: str, problems: Problems) -> Any:
    if value in CHOICES:
        return value
    problems.add(path, f"unknown CPU target {value!r}{did_you_mean(value, CHOICES)}; choose from {', '.join(CHOICES)}")
    return INVALID


def _weights_url(value: str, path: str, problems: Problems) -> Any:
    import string
    import urllib.parse

    try:
        scheme = urllib.parse.urlsplit(value).scheme
    except ValueError as exc:  # a malformed host, such as an unclosed IPv6 bracket
        problems.add(path, f"is not a URL ({exc}): {value!r}")
        return INVALID
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
    except ValueError:
        fields = None
    if scheme not in WEIGHTS_URL_SCHEMES:
        problems.add(path, f"must be an {', '.join(s + '://' for s in WEIGHTS_URL_SCHEMES)} URL, not {value!r}")
    elif fields is None or fields != ["file"]:
        problems.add(
            path,
            f"must name the weights file once as `{{file}}`, and nothing else in braces (got {value!r}); "
            "e.g. https://huggingface.co/<repo>/resolve/<revision>/{file}",
        )
    else:
        return value
    return INVALID


def _weights(value: str, path: str, problems: Problems) -> Any:
    if value in WEIGHTS:
        return value
    problems.add(path, f"must be one of {', '.join(WEIGHTS)}, not {value!r}")
    return INVALID


def _optimize(value: str, path: str, problems: Problems) -> Any:
    if value in OPTIMIZE:
        return value
    problems.add(path, f"must be one of {', '.join(OPTIMIZE)}, not {value!r}{did_you_mean(value, OPTIMIZE)}")
    return INVALID


def _backend(value: str, path: str, problems: Problems) -> Any:
    names = known()
    if value in names:
        return value
    problems.add(path, f"unknown backend {value!r}{did_you_mean(value, names)}; installed backends: {', '.join(names)}")
    return INVALID


def _package(value: str, path: str, problems: Problems) -> Any:
    if all(NAME.match(p) for p in value.split(".")):
        return value
    problems.add(path, f"must be an importable package name, not {value!r}")
    return INVALID


def _module_name(value: str, path: str, problems: Problems) -> Any:
    if is_identifier(value):
        return value
    problems.add(path, f"must be a Python module name, not {value!r}")
    return INVALID


def _torch_requirement(value: str, path: str, problems: Problems) -> Any:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        name = Requirement(value).name
    except InvalidRequirement as exc:
        problems.add(path, f"is not a valid requirement: {exc}")
        return INVALID
    if name.lower() != "torch":
        problems.add(path, f"must be a requirement on torch, not {value!r}")
        return INVALID
    return value


def _some_models(value: dict[str, Any], path: str, problems: Problems) -> Any:
    if value:
        return value
    problems.add(path, "must be a non-empty table of models")
    return INVALID


# -- the tables ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One example input declared in TOML rather than built by code."""

    EXAMPLE: typing.ClassVar[str] = '{ shape = [4, 128], dtype = "float32" }'

    shape: tuple[int | str, ...] = key(
        "sizes; a string names a dimension that may vary (see `dynamic`)",
        required="an array of sizes and dimension names",
        check=_shape,
    )
    dtype: str = key("a torch dtype name (see below)", default="float32", check=_dtype, choices=tuple(DTYPES))
    device: str | None = key(
        "device of this input", shown="the model's `device`", check=_device, pattern=DEVICE_PATTERN
    )
    low: float | None = key("lower bound of generated values (inclusive); not for `bool`", shown="`0` (integers)")
    high: float | None = key(
        "upper bound of generated values (exclusive for integers); not for `bool`", shown="`100` (integers)"
    )

    def rules(self, path: str, problems: Problems, ok: Callable[..., bool]) -> None:
        if not ok("dtype", "low", "high"):
            return
        if self.dtype == "bool" and (self.low is not None or self.high is not None):
            problems.add(path, "`low`/`high` do not apply to bool inputs (they are random true/false values)")
        elif self.dtype in INTEGER_RANGES:
            self._integer_rules(path, problems)
        elif self.low is not None and self.high is not None and self.low >= self.high:
            problems.add(path, f"`low` ({self.low}) must be below `high` ({self.high})")

    def _integer_rules(self, path: str, problems: Problems) -> None:
        """The generator's ``[low, high)`` for integers (default ``[0, 100)``) must hold a value of the dtype."""
        smallest, largest = INTEGER_RANGES[self.dtype]
        for name, value in (("low", self.low), ("high", self.high)):
            if value is not None and value != int(value):
                problems.add(f"{path}.{name}", f"must be a whole number for {self.dtype} inputs, not {value}")
                return
        low = int(self.low) if self.low is not None else max(INTEGER_DEFAULTS[0], smallest)
        high = int(self.high) if self.high is not None else min(INTEGER_DEFAULTS[1], largest)
        if low >= high:
            problems.add(
                path,
                f"`low` ({low}) must be below `high` ({high}; the default `low` is {INTEGER_DEFAULTS[0]}, "
                f"`high` {INTEGER_DEFAULTS[1]})",
            )
        elif low < smallest or high - 1 > largest:
            problems.add(path, f"[{low}, {high}) is outside what {self.dtype} holds, [{smallest}, {largest}]")


@dataclass(frozen=True)
class DimSpec:
    """Bounds of a named dimension; ``None`` leaves that side to torch.export (or the samples)."""

    EXAMPLE: typing.ClassVar[str] = "{ min = 1, max = 512 }"

    min: int | None = key("smallest size the compiled model accepts", check=_at_least_zero)
    max: int | None = key("largest size the compiled model accepts", check=_at_least_zero)

    def rules(self, path: str, problems: Problems, ok: Callable[..., bool]) -> None:
        if not ok("min", "max"):
            return
        if self.max is not None and self.max > MAX_SIZE:
            problems.add(f"{path}.max", f"must be at most 2**62 ({MAX_SIZE}), not {self.max}")
        elif self.min is not None and self.max is not None and self.min >= self.max:
            same = self.min == self.max
            problems.add(
                path,
                f"min ({self.min}) is {'equal to' if same else 'greater than'} max ({self.max})"
                + ("; a size that cannot vary is not dynamic: write it in `shape`" if same else ""),
            )


def _fraction(value: float, path: str, problems: Problems) -> Any:
    if 0 <= value <= 1:
        return float(value)
    problems.add(path, f"must be between 0 and 1, not {value!r}")
    return INVALID


@dataclass(frozen=True)
class AccuracySpec:
    """How far a lower-precision variant may be from the float32 eager model, on every output."""

    EXAMPLE: typing.ClassVar[str] = "{ rel-error = 0.02, cosine = 0.999 }"

    rel_error: float | None = key(
        "largest relative error norm, `‖y − eager‖ / ‖eager‖`, of each floating output",
        shown="by precision (see [Precision](#precision))",
        check=_fraction,
    )
    cosine: float | None = key(
        "smallest cosine similarity of each floating output with eager's",
        shown="by precision (see [Precision](#precision))",
        check=_fraction,
    )


@dataclass(frozen=True)
class ModelTable:
    """One ``models.<name>`` table as written."""

    factory: str = key(
        '`"module:attr"` of a callable returning an `nn.Module` with its weights loaded',
        required='"module:attr" of a callable returning an nn.Module',
        check=_entry_point,
        expected='a string "module:attr" (e.g. "my_pkg.models:build")',
    )
    inputs: tuple[TensorSpec, ...] | None = key(
        'positional example inputs: `[{ shape = [...], dtype = "...", device = "...", low = ..., high = ... }]`'
    )
    kwargs: dict[str, TensorSpec] = key(
        'keyword example inputs: `{ name = { shape = [...], dtype = "..." } }`', factory=dict, shown="`{}`"
    )
    example_inputs: str | None = key(
        '`"module:attr"` of a callable returning samples (see [Example inputs from code](#example-inputs-from-code)); '
        "instead of `inputs`/`kwargs`",
        check=_entry_point,
        expected='a string "module:attr" (e.g. "my_pkg.models:build")',
    )
    dynamic: dict[str, DimSpec | str] = key(
        "bounds of named dims: `{ batch = { min = 1, max = 512 } }`, or a dim's rule over another: "
        '`samples = "320*frames"` (see [Derived dims](#derived-dims))',
        factory=dict,
        shown="`{}`",
    )
    device: str = key('`"cpu"`, `"cuda"` or `"cuda:N"`', default="cpu", check=_device, pattern=DEVICE_PATTERN)
    inductor_configs: dict[str, Any] = key(
        "Inductor settings over hatch-aoti's wheel defaults and the CPU target's (see [Inductor settings]"
        "(#inductor-settings)); dotted names, quoted or as nested tables",
        factory=dict,
        shown="`{}`",
    )
    rtol: float | None = key(
        "relative tolerance of the build-time check", shown="by output dtype", check=_at_least_zero
    )
    atol: float | None = key(
        "absolute tolerance of the build-time check", shown="by output dtype", check=_at_least_zero
    )
    verify: bool = key("compare with eager at build time; `false` for models that are random by design", default=True)
    cpu_target: str | None = key(
        "`x86-64-v3`, `x86-64-v4`, `armv8-a` or `native` (see [Portable wheels](how-it-works.md#portable-wheels))",
        shown="the table's `cpu-target`",
        check=_cpu_target,
        choices=CHOICES,
    )
    backend: str | None = key(
        "how the model is compiled and loaded (see [Backends](backends.md))",
        shown="the table's `backend`",
        check=_backend,
    )
    weights: str = key(
        "`aoti` on CPU: `mapped` keeps the weights in a file the loader maps, `embedded` in the library; "
        "`auto`: mapped from 32 MiB of weights (see [Large models](performance.md#large-models))",
        default="auto",
        check=_weights,
        choices=WEIGHTS,
    )
    weights_url: str | None = key(
        '`weights = "external"`: where the weights file is served, `{file}` standing for its name '
        "(see [External weights](#external-weights))",
        check=_weights_url,
        expected="a URL string",
    )
    tune: bool | None = key(
        "`aoti`: compile a few candidate settings, verify and time each on the example inputs, and keep the "
        "fastest (see [Tuning](#tuning))",
        shown="the table's `tune`",
    )
    optimize: str | None = key(
        "`aoti` on CPU: `portable` runs on any CPU of the `cpu-target`; `host` compiles for this machine's CPU "
        "and freezes the weights at any size, for wheels that run where they are built (see [Optimizing for the "
        "build machine](#optimizing-for-the-build-machine))",
        shown="the table's `optimize`",
        check=_optimize,
        choices=OPTIMIZE,
    )

    precision: str | tuple[str, ...] | None = key(
        '`"float32"`, `"bfloat16"` or `"int8"`, or a list of them in order of preference: each is built, verified '
        "and shipped as a variant, and the loader takes the first this CPU runs natively (see [Precision](#precision))",
        shown="the table's `precision`",
        check=_precision,
        expected='a precision or a list of them (e.g. ["bfloat16", "float32"])',
    )
    calibration: str | None = key(
        '`int8`: `"module:attr"` of a callable returning samples shaped like the example inputs\' ones; '
        "convolutions are quantized only with it, else take the next variant's precision (see [Precision](#precision))",
        check=_entry_point,
        expected='a string "module:attr" (e.g. "my_pkg.models:calibration")',
    )
    accuracy: dict[str, AccuracySpec] = key(
        "the build-time check of each lower-precision variant, by precision: "
        "`{ bfloat16 = { rel-error = 0.02, cosine = 0.999 } }` (see [Precision](#precision))",
        factory=dict,
        shown="by precision",
    )

    def rules(self, path: str, problems: Problems, ok: Callable[..., bool]) -> None:
        if ok("weights", "weights_url"):
            if self.weights == "external" and self.weights_url is None:
                problems.add(f"{path}.weights-url", 'is required with `weights = "external"`: where the file is served')
            elif self.weights != "external" and self.weights_url is not None:
                problems.add(f"{path}.weights-url", 'applies only with `weights = "external"`')
        if ok("weights", "device") and self.weights == "external" and self.device != "cpu":
            problems.add(f"{path}.weights", f"`external` is for CPU models, not {self.device}")
        if ok("weights", "device") and self.weights == "mapped" and self.device != "cpu":
            problems.add(
                f"{path}.weights",
                f"`mapped` is for CPU models; a {self.device} model's weights are "
                "copied to the device anyway: use `embedded` or `auto`",
            )
        # A key with problems of its own still counts as given.
        inputs = self.inputs is not None or not ok("inputs")
        example = self.example_inputs is not None or not ok("example_inputs")
        kwargs = bool(self.kwargs) or not ok("kwargs")
        if inputs and example:
            problems.add(path, "give either `inputs` or `example-inputs`, not both")
        elif example and kwargs:
            problems.add(f"{path}.kwargs", "cannot be combined with `example-inputs`; return kwargs from it")
        elif not (inputs or example or kwargs):
            problems.add(
                path, 'needs example inputs: `inputs = [{ shape = [...], dtype = "..." }]` or `example-inputs`'
            )
        rules = {name: rule for name, rule in self.dynamic.items() if isinstance(rule, str)}
        if rules:
            self._check_rules(rules, path, problems)
        if not example and ok("inputs", "kwargs"):
            used = {d for t in (*(self.inputs or ()), *self.kwargs.values()) for d in t.shape if isinstance(d, str)}
            roots = {parsed[0] for parsed in map(parse_rule, rules.values()) if parsed}
            for name in self.dynamic:
                if name not in used and name not in roots:
                    problems.add(f"{path}.dynamic.{name}", "is not used by any input shape")

    def _check_rules(self, rules: dict[str, str], path: str, problems: Problems) -> None:
        """Each rule names another dim that is not itself derived, and gives sizes >= 0 over its bounds."""
        for name, text in rules.items():
            where, parsed = f"{path}.dynamic.{name}", parse_rule(text)
            if parsed is None:
                problems.add(
                    where,
                    f'must be a rule like "320*frames" or "2*n + 1" (a positive multiple of '
                    f"another dim, plus or minus a size), not {text!r}",
                )
                continue
            root, mult, offset = parsed
            bounds = self.dynamic.get(root)
            used = {d for t in (*(self.inputs or ()), *self.kwargs.values()) for d in t.shape if isinstance(d, str)}
            if root == name or isinstance(bounds, str):
                problems.add(where, f"{text!r} must be over a dim with bounds of its own, not a derived one")
            elif bounds is None and root not in used:
                problems.add(
                    where,
                    f"{text!r} names {root!r}, which no input shape uses; give its bounds as "
                    f"`dynamic.{root} = {{ min = ..., max = ... }}`",
                )
            elif offset < 0 and (bounds is None or bounds.min is None or mult * bounds.min + offset < 0):
                low = bounds.min if isinstance(bounds, DimSpec) and bounds.min is not None else 0
                problems.add(
                    where,
                    f"{text!r} is {mult * low + offset} at {root} = {low}; give "
                    f"`dynamic.{root}.min` so that every {name} is >= 0",
                )


@dataclass(frozen=True)
class Table:
    """The whole hatch-aoti table as written (hook table or ``[tool.hatch-aoti]``)."""

    package: str | None = key(
        "package that receives the loader and `_aoti/` artifacts; required if the wheel has several",
        shown="the wheel's only top-level package",
        check=_package,
    )
    loader: str = key("name of the loader package (`my_pkg.compiled`)", default="compiled", check=_module_name)
    torch_requirement: str | None = key(
        "`Requires-Dist` written for torch (setuptools, where `[project] dynamic` lists `dependencies`; otherwise "
        "state torch in `[project] dependencies`); must allow the torch that builds the wheel",
        shown="`torch==X.Y.*` of the build torch",
        check=_torch_requirement,
    )
    cpu_target: str | None = key(
        "default [CPU target](how-it-works.md#portable-wheels) of the models",
        shown="`x86-64-v3` on x86-64",
        check=_cpu_target,
        choices=CHOICES,
    )
    backend: str = key(
        "default [backend](backends.md) of the models: `aoti`, `precompile` or an installed one",
        default="aoti",
        check=_backend,
    )
    tune: bool = key("default `tune` of the models (`aoti` models; see [Tuning](#tuning))", default=False)
    precision: str | tuple[str, ...] = key(
        "default `precision` of the models (see [Precision](#precision))",
        default="float32",
        check=_precision,
        expected='a precision or a list of them (e.g. ["bfloat16", "float32"])',
    )
    optimize: str = key(
        "default `optimize` of the models (see [Optimizing for the build machine](#optimizing-for-the-build-machine))",
        default=PORTABLE,
        check=_optimize,
        choices=OPTIMIZE,
    )
    weights_dir: str = key(
        'where a build writes the files of `weights = "external"` models, relative to the directory that '
        "holds the wheel's (`dist-weights/` beside `dist/`, so that `twine upload dist/*` uploads only the wheel)",
        default="dist-weights",
    )
    models: dict[str, ModelTable] = key(
        "one table per model; `<name>` must be a Python identifier",
        required="declare at least one [..models.<name>] table",
        check=_some_models,
        factory=dict,
    )
