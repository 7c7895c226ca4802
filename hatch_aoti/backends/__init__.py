"""Backends: how a checked, exported model becomes files in the wheel, and how those load.

A backend is a :class:`Backend` registered under the ``hatch_aoti.backends`` entry-point
group (hatch-aoti's own ``aoti`` and ``precompile`` are registered there too). It
compiles a model into files, says what the wheel must pin (the torch requirement and
the interpreter tag), and names the run-time code that loads its files. Backend modules
must not import torch at import time: the build backend process reads their pins.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from hatch_aoti.backends.interface import Backend, InputPlan, Pins, ProgramFacts, Request
from hatch_aoti.settings.registry import BUILTIN, DEFAULT, GROUP, known

if TYPE_CHECKING:
    from hatch_aoti.settings.spec import ModelSpec

__all__ = [
    "BUILTIN",
    "DEFAULT",
    "GROUP",
    "Backend",
    "InputPlan",
    "Pins",
    "ProgramFacts",
    "Request",
    "combined_pins",
    "get",
    "known",
    "problems",
]


def get(name: str) -> Backend:
    """The backend called ``name``; a :class:`LookupError` says why not."""
    if name == "aoti":
        from hatch_aoti.backends.aoti import AotiBackend

        return AotiBackend()
    if name == "precompile":
        from hatch_aoti.backends.precompile import PrecompileBackend

        return PrecompileBackend()
    found = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise LookupError(f"no backend {name!r} is installed (known: {', '.join(known())})")
    try:
        loaded = found[0].load()
    except Exception as exc:
        raise LookupError(f"backend {name!r} ({found[0].value}) cannot be imported: {exc}") from None
    backend = loaded() if isinstance(loaded, type) else loaded
    if not isinstance(backend, Backend):
        raise LookupError(f"backend {name!r} ({found[0].value}) is not a hatch_aoti.backends.Backend")
    return backend


def problems(spec: ModelSpec) -> list[tuple[str, str]]:
    """What the model's backend cannot compile, by TOML path (an unknown backend is the reader's problem)."""
    try:
        backend = get(spec.backend)
    except LookupError:
        return []
    return backend.check(spec)


def combined_pins(pins: list[Pins]) -> Pins:
    """The narrowest requirement across a wheel's models: an exact torch pin wins over a series."""
    exact = [p.torch for p in pins if "==" in p.torch and "*" not in p.torch and "," not in p.torch]
    tags = sorted({p.python_tag for p in pins} - {"py3"})
    if len(tags) > 1:
        raise ValueError(f"the models need different Pythons ({', '.join(tags)}); build them in separate wheels")
    return Pins(exact[0] if exact else pins[0].torch, tags[0] if tags else "py3")
