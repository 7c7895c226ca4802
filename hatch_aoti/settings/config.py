"""Read the hatch-aoti table of ``pyproject.toml`` into typed settings, then into model specs.

Pure Python (no torch): a bad table is reported in milliseconds, every problem at once
with its full TOML path. The tables are dataclasses whose fields carry their own
documentation; one generic reader checks keys, types and values for all of them, and
the reference tables of ``docs/configuration.md`` and the JSON schema are generated from the same fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import keyword
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: Where each front end's users write the table.
HATCH_TABLE = "tool.hatch.build.targets.wheel.hooks.aoti"
SETUPTOOLS_TABLE = "tool.hatch-aoti"

#: torch dtypes by the names users write, mapped to the ``torch`` attribute.
DTYPES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "float64": "float64",
    "double": "float64",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "complex64": "complex64",
    "cfloat": "complex64",
    "complex128": "complex128",
    "cdouble": "complex128",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "short": "int16",
    "int32": "int32",
    "int": "int32",
    "int64": "int64",
    "long": "int64",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}

#: The values each integer dtype holds (uint64's as far as the generator's int64 reaches).
INTEGER_RANGES: dict[str, tuple[int, int]] = {
    **{f"int{b}": (-(2 ** (b - 1)), 2 ** (b - 1) - 1) for b in (8, 16, 32, 64)},
    **{f"uint{b}": (0, min(2**b, 2**63) - 1) for b in (8, 16, 32, 64)},
}
#: The ``[low, high)`` generated integers are drawn from where an input sets neither (within its dtype).
INTEGER_DEFAULTS = (0, 100)
#: The largest size a dim may be declared with: torch.export's own bounds stop below it.
MAX_SIZE = 2**62

_ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)\Z")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+\Z")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_RULE = re.compile(r"^\s*(?:(\d+)\s*\*\s*)?([A-Za-z_]\w*)\s*(?:\*\s*(\d+)\s*)?(?:([+-])\s*(\d+)\s*)?\Z")


def parse_rule(text: str) -> tuple[str, int, int] | None:
    """``"320*frames"``, ``"2*n + 1"``, ``"n - 1"``: (root, multiple, offset); ``None`` if it is not of that form."""
    found = _RULE.match(text)
    if found is None or (found[1] and found[3]):
        return None
    mult = int(found[1] or found[3] or 1)
    offset = int(found[5] or 0) * (-1 if found[4] == "-" else 1)
    return (found[2], mult, offset) if mult > 0 else None


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
        if (path, message) not in self.items:  # a table's problem, found through each of its models
            self.items.append((path, message))

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)


# -- the generic reader ------------------------------------------------------------------

_INVALID = object()
Check = Callable[[Any, str, Problems], Any]


@dataclass(frozen=True)
class Key:
    """What the reader and the generated docs know about one TOML key."""

    doc: str
    shown: str | None = None
    """The default as the docs show it, where the Python default says too little."""
    required: str | None = None
    """Why the key is needed, for the message when it is missing."""
    check: Check | None = None
    """Further checks of a well-typed value: returns the value to keep, or ``_INVALID``."""
    expected: str | None = None
    """What a value of the wrong type is told to be instead of the type's plain name."""


def key(
    doc: str,
    *,
    default: Any = None,
    factory: Callable[[], Any] | None = None,
    shown: str | None = None,
    required: str | None = None,
    check: Check | None = None,
    expected: str | None = None,
) -> Any:
    meta = {"key": Key(doc, shown, required, check, expected)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def toml_keys(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The TOML spelling of each documented field of a table class."""
    return {f.name.replace("_", "-"): f for f in dataclasses.fields(cls) if "key" in f.metadata}


def read(cls: type, raw: Any, path: str, problems: Problems) -> Any:
    """An instance of the table class ``cls`` from ``raw``, or ``None`` with its problems added."""
    start = len(problems.items)
    obj = read_partly(cls, raw, path, problems)
    return obj if len(problems.items) == start else None


def read_partly(cls: type, raw: Any, path: str, problems: Problems) -> Any:
    """``cls`` from the keys of ``raw`` that read well (defaults for the others), or ``None`` if not a table.

    The class's ``rules`` (checks across keys) run even when some keys have problems, on
    the keys that read well (``ok(*fields)`` says which), so that one build lists them all.
    """
    if not isinstance(raw, dict):
        problems.add(path, f"must be a table like {cls.EXAMPLE}" if hasattr(cls, "EXAMPLE") else "must be a table")
        return None
    keys = toml_keys(cls)
    unknown_keys(raw, tuple(keys), path, problems)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    flawed: set[str] = set()
    for name, f in keys.items():
        meta: Key = f.metadata["key"]
        where = f"{path}.{name}"
        if name not in raw:
            if meta.required:
                problems.add(where, f"is required: {meta.required}")
                flawed.add(f.name)
            continue
        before = len(problems.items)
        value = conform(hints[f.name], raw[name], where, problems, meta.expected)
        if value is not _INVALID and meta.check is not None and len(problems.items) == before:
            value = meta.check(value, where, problems)
        if len(problems.items) > before:
            flawed.add(f.name)
        if value is not _INVALID:
            values[f.name] = value  # a table of tables keeps the entries that read well
    obj = cls(**{k: v for k, v in values.items() if k not in flawed or isinstance(v, dict)})
    rules = getattr(obj, "rules", None)
    if rules is not None:
        rules(path, problems, lambda *fields: not flawed.intersection(fields))
    return obj


def conform(tp: Any, value: Any, path: str, problems: Problems, expected: str | None = None) -> Any:
    """``value`` checked against the type ``tp`` (arrays become tuples), or ``_INVALID``.

    Tables of tables (``models``, ``kwargs``, ``dynamic``) are keyed by Python identifiers.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return conform(options[0], value, path, problems, expected)
        tables = [a for a in options if dataclasses.is_dataclass(a)]
        if tables and isinstance(value, dict):  # `{ min = 1 }` read as its table, with its own checks
            return conform(tables[0], value, path, problems, expected)
        if any(_matches(a, value) for a in options):
            return value
        problems.add(path, f"must be {expected or describe(tp)}, not {value!r}")
        return _INVALID
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        result = read(tp, value, path, problems)
        return _INVALID if result is None else result
    if origin in (tuple, list):
        if not isinstance(value, list):
            problems.add(path, f"must be {describe(tp)}, not {value!r}")
            return _INVALID
        elements = [conform(args[0], v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return _INVALID if any(e is _INVALID for e in elements) else tuple(elements)
    if origin is dict:
        if not isinstance(value, dict):
            problems.add(path, f"must be {describe(tp)}, not {value!r}")
            return _INVALID
        for name in value:
            if dataclasses.is_dataclass(args[1]) and not is_identifier(name):
                problems.add(
                    toml_path(path, name),
                    "names here must be Python identifiers (ASCII letters, digits, `_`) and not Python keywords",
                )
        items = {k: conform(args[1], v, toml_path(path, k), problems) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _INVALID}
    if _matches(tp, value):
        return value
    problems.add(path, f"must be {expected or describe(tp)}, not {value!r}")
    return _INVALID


def toml_path(path: str, name: str) -> str:
    """``path.name``, the name quoted as TOML writes it where it is not a bare key."""
    return f"{path}.{name}" if _BARE_KEY.match(name) else f"{path}.{json.dumps(name)}"


def model_path(table: str, name: str) -> str:
    """The TOML path of model ``name``'s table."""
    return toml_path(f"{table}.models", name)


def is_identifier(name: Any) -> bool:
    return isinstance(name, str) and bool(_NAME.match(name)) and not keyword.iskeyword(name)


def _matches(tp: Any, value: Any) -> bool:
    if tp is Any:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, tp)


def describe(tp: Any) -> str:
    """How the docs and the messages name a type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args if a is not type(None))
    if origin in (tuple, list):
        return "an array"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "a value")


def did_you_mean(value: str, known: Iterable[str]) -> str:
    """`` (did you mean `x`?)`` for the closest known name, or ``""``: every such hint reads the same."""
    close = difflib.get_close_matches(value, list(known), n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


def unknown_keys(table: dict[str, Any], allowed: tuple[str, ...], path: str, problems: Problems) -> None:
    for name in table:
        if name in allowed:
            continue
        hint = did_you_mean(str(name), allowed) or f"; known keys: {', '.join(allowed)}"
        problems.add(toml_path(path, name), f"unknown key{hint}")


def reference(cls: type) -> Iterator[tuple[str, str, str]]:
    """(key, default, meaning) rows of one table, for ``docs/configuration.md``."""
    for name, f in toml_keys(cls).items():
        meta: Key = f.metadata["key"]
        if meta.shown is not None:
            default = meta.shown
        elif meta.required:
            default = "(required)"
        elif f.default is None or f.default is dataclasses.MISSING:
            default = ""
        else:
            default = f"`{_toml_literal(f.default)}`"
        yield f"`{name}`", default, meta.doc


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


# -- value checks --------------------------------------------------------------------------


def _entry_point(value: str, path: str, problems: Problems) -> Any:
    if _ENTRY_POINT.match(value):
        return value
    problems.add(path, f'must be a string "module:attr" (e.g. "my_pkg.models:build"), not {value!r}')
    return _INVALID


def _device(value: str, path: str, problems: Problems) -> Any:
    if _DEVICE.match(value):
        return value
    problems.add(path, f'must be "cpu", "cuda" or "cuda:N", not {value!r}')
    return _INVALID


def _dtype(value: str, path: str, problems: Problems) -> Any:
    if value in DTYPES:
        return DTYPES[value]
    hint = did_you_mean(value, DTYPES) or f"; known: {', '.join(sorted(set(DTYPES.values())))}"
    problems.add(path, f"unknown dtype {value!r}{hint}")
    return _INVALID


def _shape(value: tuple[Any, ...], path: str, problems: Problems) -> Any:
    ok = True
    for i, dim in enumerate(value):
        if not (_matches(int, dim) and dim >= 0) and not (isinstance(dim, str) and _NAME.match(dim)):
            problems.add(f"{path}[{i}]", f"must be a size >= 0 or a dimension name, not {dim!r}")
            ok = False
    return value if ok else _INVALID


def _at_least_zero(value: float, path: str, problems: Problems) -> Any:
    if value >= 0:
        return value
    problems.add(path, f"must be >= 0, not {value!r}")
    return _INVALID


def _cpu_target(value: str, path: str, problems: Problems) -> Any:
    from hatch_aoti.settings.cpu_targets import CHOICES

    if value in CHOICES:
        return value
    problems.add(path, f"unknown CPU target {value!r}{did_you_mean(value, CHOICES)}; choose from {', '.join(CHOICES)}")
    return _INVALID


WEIGHTS = ("auto", "mapped", "embedded", "external")
#: Schemes a `weights-url` may use: the pinned sha256 guards the bytes whatever the transport.
WEIGHTS_URL_SCHEMES = ("https", "http", "file")


def _weights_url(value: str, path: str, problems: Problems) -> Any:
    import string
    import urllib.parse

    try:
        scheme = urllib.parse.urlsplit(value).scheme
    except ValueError as exc:  # a malformed host, such as an unclosed IPv6 bracket
        problems.add(path, f"is not a URL ({exc}): {value!r}")
        return _INVALID
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
    return _INVALID


def _weights(value: str, path: str, problems: Problems) -> Any:
    if value in WEIGHTS:
        return value
    problems.add(path, f"must be one of {', '.join(WEIGHTS)}, not {value!r}")
    return _INVALID


#: `optimize`: fast defaults that run on any CPU of the target, or compiled for this one.
PORTABLE, HOST = "portable", "host"
OPTIMIZE = (PORTABLE, HOST)


def applied_optimize(own: Any, table: Any) -> str:
    """A model's `optimize`: its own, else the table's (either as written, valid or not)."""
    return own if own in OPTIMIZE else table if table in OPTIMIZE else PORTABLE


def _optimize(value: str, path: str, problems: Problems) -> Any:
    if value in OPTIMIZE:
        return value
    problems.add(path, f"must be one of {', '.join(OPTIMIZE)}, not {value!r}{did_you_mean(value, OPTIMIZE)}")
    return _INVALID


def _backend(value: str, path: str, problems: Problems) -> Any:
    from hatch_aoti.backends.interface import known

    names = known()
    if value in names:
        return value
    problems.add(path, f"unknown backend {value!r}{did_you_mean(value, names)}; installed backends: {', '.join(names)}")
    return _INVALID


def _package(value: str, path: str, problems: Problems) -> Any:
    if all(_NAME.match(p) for p in value.split(".")):
        return value
    problems.add(path, f"must be an importable package name, not {value!r}")
    return _INVALID


def _module_name(value: str, path: str, problems: Problems) -> Any:
    if is_identifier(value):
        return value
    problems.add(path, f"must be a Python module name, not {value!r}")
    return _INVALID


def _torch_requirement(value: str, path: str, problems: Problems) -> Any:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        name = Requirement(value).name
    except InvalidRequirement as exc:
        problems.add(path, f"is not a valid requirement: {exc}")
        return _INVALID
    if name.lower() != "torch":
        problems.add(path, f"must be a requirement on torch, not {value!r}")
        return _INVALID
    return value


def _some_models(value: dict[str, Any], path: str, problems: Problems) -> Any:
    if value:
        return value
    problems.add(path, "must be a non-empty table of models")
    return _INVALID


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
    dtype: str = key("a torch dtype name (see below)", default="float32", check=_dtype)
    device: str | None = key("device of this input", shown="the model's `device`", check=_device)
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
    device: str = key('`"cpu"`, `"cuda"` or `"cuda:N"`', default="cpu", check=_device)
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
    loader: str = key("module name of the generated loader (`my_pkg.compiled`)", default="compiled", check=_module_name)
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
    )
    backend: str = key(
        "default [backend](backends.md) of the models: `aoti`, `precompile` or an installed one",
        default="aoti",
        check=_backend,
    )
    tune: bool = key("default `tune` of the models (`aoti` models; see [Tuning](#tuning))", default=False)
    optimize: str = key(
        "default `optimize` of the models (see [Optimizing for the build machine](#optimizing-for-the-build-machine))",
        default=PORTABLE,
        check=_optimize,
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


# -- specs: what the build works from ---------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One model, validated and resolved against the table's defaults."""

    name: str
    factory: str
    inputs: tuple[TensorSpec, ...] | None
    """Positional example inputs declared in TOML, or ``None`` when ``example-inputs`` is used."""
    kwargs: dict[str, TensorSpec]
    example_inputs: str | None
    dynamic: dict[str, DimSpec | str]
    device: str = "cpu"
    inductor_configs: dict[str, Any] = field(default_factory=dict)
    rtol: float | None = None
    atol: float | None = None
    verify: bool = True
    cpu_target: str = "native"
    """The model's own, the table's, or the machine's default."""
    backend: str = "aoti"
    """The model's own, or the table's."""
    weights: str = "auto"
    path: str = ""
    """Full TOML path of the model's table, for messages."""
    weights_url: str | None = None
    """``weights = "external"``: the URL template of the weights file."""
    tune: bool = False
    """Compile candidate settings and keep the fastest that verifies (the model's own, or the table's)."""
    weights_bytes: int | None = None
    """Bytes of the exported program's weights, once it is exported (the size-based defaults use it)."""
    optimize: str = PORTABLE
    """``host``: compiled for the build machine's CPU (the model's own, or the table's)."""
    repackable: bool = True
    """Whether the weights Inductor packs for oneDNN can ship dense, once exported (see ``fast_defaults``)."""
    weighted_macs: int | None = None
    """Mean multiply-adds of the exported program's matrix products by a weight, at the example
    inputs' sizes (a model exported at batch 1 counts batch 1)."""
    weighted_products: int = 0
    """How many matrix products by a weight the exported program has (those ``weighted_macs`` counts)."""
    convolutions: int = 0
    """How many convolutions by a weight the exported program has (those gain from packing at any size)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSpec:
        data = dict(data)
        if data["inputs"] is not None:
            data["inputs"] = tuple(_tensor_from_json(t) for t in data["inputs"])
        data["kwargs"] = {k: _tensor_from_json(v) for k, v in data["kwargs"].items()}
        data["dynamic"] = {k: DimSpec(**v) if isinstance(v, dict) else v for k, v in data["dynamic"].items()}
        return cls(**data)


def _tensor_from_json(data: dict[str, Any]) -> TensorSpec:
    return TensorSpec(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class Settings:
    """The whole table, validated, with each model resolved."""

    models: tuple[ModelSpec, ...]
    package: str | None = None
    loader: str = "compiled"
    torch_requirement: str | None = None
    cpu_target: str | None = None
    table: str = HATCH_TABLE
    """The TOML path the user wrote the settings under."""
    weights_dir: str = "dist-weights"
    """Where external weights files go, relative to the project."""


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
    from hatch_aoti.settings.cpu_targets import default_target, host_flags

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
    from hatch_aoti.settings.cpu_targets import CHOICES, NATIVE, OWNED_CONFIGS

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
    from hatch_aoti.settings.cpu_targets import TARGETS

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
