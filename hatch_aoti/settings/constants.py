"""The settings' values that other parts share: table names, dtypes, integer ranges, the closed choices
of some keys and the grammar of derived dims.

Imports nothing of the project, so that the worker's input generator and the backends may read
them without reaching the reader.
"""

from __future__ import annotations

import re

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

WEIGHTS = ("auto", "mapped", "embedded", "external")
#: Schemes a `weights-url` may use: the pinned sha256 guards the bytes whatever the transport.
WEIGHTS_URL_SCHEMES = ("https", "http", "file")

#: `optimize`: fast defaults that run on any CPU of the target, or compiled for this one.
PORTABLE, HOST = "portable", "host"
OPTIMIZE = (PORTABLE, HOST)

_RULE = re.compile(r"^\s*(?:(\d+)\s*\*\s*)?([A-Za-z_]\w*)\s*(?:\*\s*(\d+)\s*)?(?:([+-])\s*(\d+)\s*)?\Z")


def parse_rule(text: str) -> tuple[str, int, int] | None:
    """``"320*frames"``, ``"2*n + 1"``, ``"n - 1"``: (root, multiple, offset); ``None`` if it is not of that form."""
    found = _RULE.match(text)
    if found is None or (found[1] and found[3]):
        return None
    mult = int(found[1] or found[3] or 1)
    offset = int(found[5] or 0) * (-1 if found[4] == "-" else 1)
    return (found[2], mult, offset) if mult > 0 else None


#: The build-time check of each lower precision when `accuracy` leaves it: every floating output's
#: relative error norm against the float32 model at most ``rel_error``, its cosine similarity at least
#: ``cosine`` (how they were chosen: docs/configuration.md#precision).
ACCURACY: dict[str, dict[str, float]] = {
    "bfloat16": {"rel_error": 0.02, "cosine": 0.999},
    "int8": {"rel_error": 0.1, "cosine": 0.99},
}
