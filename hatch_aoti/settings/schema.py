"""A JSON schema of ``[tool.hatch-aoti]``, made from the same settings classes as the reader.

validate-pyproject finds it through its ``validate_pyproject.tool_schema`` entry point, and
editors through ``docs/hatch-aoti.schema.json``: a misspelt key or a value outside a closed key's
choices (``weights``, ``optimize``, ``cpu-target``, ``dtype``, the form of ``device``) fails there,
before any build. ``backend`` stays open: installed packages add backends. The reader stays the
authority; the schema checks keys, types and choices, not the rules across them, and JSON Schema
takes ``2.0`` for an integer and cannot name ``nan``, both of which the reader refuses.
"""

from __future__ import annotations

import dataclasses
import keyword
import types
import typing
from typing import Any

from hatch_aoti.settings.model import Table
from hatch_aoti.settings.reader import Key, toml_keys

ID = "urn:hatch-aoti:tool.hatch-aoti"
#: What :func:`hatch_aoti.settings.reader.is_identifier` accepts, as an ECMA-262 pattern.
IDENTIFIER = f"^(?!(?:{'|'.join(keyword.kwlist)})$)[A-Za-z_][A-Za-z0-9_]*$"


def tool_schema(tool_name: str = "hatch-aoti") -> dict[str, Any]:
    """The entry point validate-pyproject calls for ``[tool.hatch-aoti]``."""
    if tool_name != "hatch-aoti":
        raise ValueError(f"hatch-aoti has a schema for tool.hatch-aoti only, not tool.{tool_name}")
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": ID,
        "description": "hatch-aoti's settings: the models to compile into the wheel.",
        **of_type(Table),
    }


def of_type(tp: Any) -> dict[str, Any]:
    """The schema of one settings type, as :func:`hatch_aoti.settings.reader.conform` reads it."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [of_type(a) for a in args if a is not type(None)]
        return options[0] if len(options) == 1 else {"anyOf": options}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _table(tp)
    if origin in (tuple, list):
        return {"type": "array", "items": of_type(args[0])}
    if origin is dict:
        names = {"propertyNames": {"pattern": IDENTIFIER}} if dataclasses.is_dataclass(args[1]) else {}
        return {"type": "object", **names, "additionalProperties": of_type(args[1])}
    return {
        bool: {"type": "boolean"},
        int: {"type": "integer"},
        float: {"type": "number"},
        str: {"type": "string"},
    }.get(tp, {})


def _table(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties, required = {}, []
    for name, f in toml_keys(cls).items():
        meta: Key = f.metadata["key"]
        properties[name] = {"description": meta.doc, **of_type(hints[f.name])}
        if meta.choices is not None:
            properties[name]["enum"] = list(meta.choices)
        if meta.pattern is not None:
            properties[name]["pattern"] = meta.pattern
        if meta.required:
            required.append(name)
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        **({"required": required} if required else {}),
    }
