"""The one strict reader of the settings tables: keys, types and values, every problem at once.

The tables are dataclasses whose fields carry their own documentation (:func:`key`); one
generic reader checks keys, types and values for all of them, each problem with its full TOML
path, and the reference tables of ``docs/configuration.md`` and the JSON schema are generated
from the same fields. Pure Python (no torch): a bad table is reported in milliseconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import keyword
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+\Z")
#: A Python identifier's form (keywords apart: see :func:`is_identifier`).
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


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

INVALID = object()
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
    """Further checks of a well-typed value: returns the value to keep, or ``INVALID``."""
    expected: str | None = None
    """What a value of the wrong type is told to be instead of the type's plain name."""
    choices: tuple[str, ...] | None = None
    """The values a closed key takes, for the JSON schema (``check`` refuses the others)."""
    pattern: str | None = None
    """The form of a closed key's values where they are too many to list, as an ECMA-262 pattern."""


def key(
    doc: str,
    *,
    default: Any = None,
    factory: Callable[[], Any] | None = None,
    shown: str | None = None,
    required: str | None = None,
    check: Check | None = None,
    expected: str | None = None,
    choices: tuple[str, ...] | None = None,
    pattern: str | None = None,
) -> Any:
    meta = {"key": Key(doc, shown, required, check, expected, choices, pattern)}
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
        if value is not INVALID and meta.check is not None and len(problems.items) == before:
            value = meta.check(value, where, problems)
        if len(problems.items) > before:
            flawed.add(f.name)
        if value is not INVALID:
            values[f.name] = value  # a table of tables keeps the entries that read well
    obj = cls(**{k: v for k, v in values.items() if k not in flawed or isinstance(v, dict)})
    rules = getattr(obj, "rules", None)
    if rules is not None:
        rules(path, problems, lambda *fields: not flawed.intersection(fields))
    return obj


def conform(tp: Any, value: Any, path: str, problems: Problems, expected: str | None = None) -> Any:
    """``value`` checked against the type ``tp`` (arrays become tuples), or ``INVALID``.

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
        arrays = [a for a in options if typing.get_origin(a) in (tuple, list)]
        if arrays and isinstance(value, list):  # `["bfloat16", "float32"]` read as its array
            return conform(arrays[0], value, path, problems, expected)
        if any(matches(a, value) for a in options if typing.get_origin(a) is None):
            return value
        problems.add(path, f"must be {expected or describe(tp)}, not {value!r}")
        return INVALID
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        result = read(tp, value, path, problems)
        return INVALID if result is None else result
    if origin in (tuple, list):
        if not isinstance(value, list):
            problems.add(path, f"must be {describe(tp)}, not {value!r}")
            return INVALID
        elements = [conform(args[0], v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return INVALID if any(e is INVALID for e in elements) else tuple(elements)
    if origin is dict:
        if not isinstance(value, dict):
            problems.add(path, f"must be {describe(tp)}, not {value!r}")
            return INVALID
        for name in value:
            if dataclasses.is_dataclass(args[1]) and not is_identifier(name):
                problems.add(
                    toml_path(path, name),
                    "names here must be Python identifiers (ASCII letters, digits, `_`) and not Python keywords",
                )
        items = {k: conform(args[1], v, toml_path(path, k), problems) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not INVALID}
    if matches(tp, value):
        return value
    problems.add(path, f"must be {expected or describe(tp)}, not {value!r}")
    return INVALID


def toml_path(path: str, name: str) -> str:
    """``path.name``, the name quoted as TOML writes it where it is not a bare key."""
    return f"{path}.{name}" if _BARE_KEY.match(name) else f"{path}.{json.dumps(name)}"


def model_path(table: str, name: str) -> str:
    """The TOML path of model ``name``'s table."""
    return toml_path(f"{table}.models", name)


def is_identifier(name: Any) -> bool:
    return isinstance(name, str) and bool(NAME.match(name)) and not keyword.iskeyword(name)


def matches(tp: Any, value: Any) -> bool:
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
