"""Backends: how a checked, exported model becomes files in the wheel, and how those load.

A backend is a :class:`Backend` registered under the ``hatch_aoti.backends`` entry-point
group (hatch-aoti's own ``aoti`` and ``precompile`` are registered there too). It
compiles a model into files, says what the wheel must pin (the torch requirement and
the interpreter tag), and names the run-time code that loads its files. Backend modules
must not import torch at import time: the build backend process reads their pins.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

GROUP = "hatch_aoti.backends"
BUILTIN = ("aoti", "precompile")
DEFAULT = "aoti"


@dataclass(frozen=True)
class Pins:
    """What a wheel holding a backend's artifacts must require of the machine that installs it."""

    torch: str
    """``Requires-Dist`` on torch, e.g. ``torch==2.13.*``."""
    python_tag: str = "py3"
    """The wheel's interpreter tag: ``py3``, or ``cpXY`` for artifacts tied to one Python."""


@dataclass
class Request:
    """One model to compile, as the coordinator (or a compile helper) has it."""

    name: str
    exported: Any
    """The ``torch.export.ExportedProgram`` the cache key was computed from."""
    settings: dict[str, Any]
    """What :meth:`Backend.settings` returned for this model."""
    out: Path
    """Directory that receives the model's files (``_aoti/<model>/`` in the wheel)."""
    work: Path
    """Scratch directory, emptied by the caller."""
    module: Any = None
    """The eager ``nn.Module`` (``None`` in compile helpers: see :attr:`Backend.in_helpers`)."""
    plan: Any = None
    """The model's :class:`hatch_aoti.inputs.InputPlan`: example inputs and dynamic dims."""
    loader: str = ""
    """Import name the generated loader has at run time (``my_pkg.compiled``)."""
    factory: str = ""
    """``module:attr`` of the model's factory."""
    spec: Any = None
    """The model's :class:`hatch_aoti.config.ModelSpec` (its ``dynamic`` table as declared, say)."""


class Backend:
    """Subclass this, register the subclass under ``hatch_aoti.backends``, and name it in ``backend``."""

    name: ClassVar[str]
    #: A Python file shipped as ``_aoti/runtime/<name>.py`` when a wheel holds this backend's
    #: models; it defines ``load(name, entry, directory)`` returning the model's callable
    #: (torch and the standard library only). ``None``: the generated loader itself loads it.
    runtime: ClassVar[Path | None] = None
    #: Whether a compile helper can compile a saved exported program (no eager module there).
    #: If not, the model compiles in the coordinator, with its eager module and the loader's
    #: import name, and its cache key includes that name and the factory's: files may refer to them.
    in_helpers: ClassVar[bool] = False

    def settings(self, user_configs: dict[str, Any], target: Any, spec: Any) -> dict[str, Any]:
        """The settings a model compiles with (shown by ``info()`` and part of the cache key).

        ``user_configs`` are the model's ``inductor-configs``, ``target`` its resolved CPU
        target, ``spec`` its :class:`hatch_aoti.config.ModelSpec`.
        """
        return dict(user_configs)

    def key(self) -> dict[str, Any]:
        """Anything else the artifact depends on, for the cache key."""
        return {}

    def check(self, spec: Any) -> list[tuple[str, str]]:
        """Problems with a model this backend cannot compile, by TOML path, found before exporting."""
        return []

    def compile(self, request: Request) -> dict[str, Any]:
        """Write the model's files into ``request.out``; return the manifest entry's fields about them.

        The fields must include ``file`` (the main file, relative to ``request.out``) and
        ``sha256`` (of that file). Raise any exception for a failed compile.
        """
        raise NotImplementedError

    def pins(self, torch_version: str) -> Pins:
        from hatch_aoti.platform_tag import torch_requirement

        return Pins(torch_requirement(torch_version))


def known() -> list[str]:
    """Names of the installed backends, without importing them."""
    names = {ep.name for ep in importlib.metadata.entry_points(group=GROUP)}
    return [*BUILTIN, *sorted(names - set(BUILTIN))]


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
    except Exception as exc:  # noqa: BLE001 - a broken plugin is reported, not raised
        raise LookupError(f"backend {name!r} ({found[0].value}) cannot be imported: {exc}") from None
    backend = loaded() if isinstance(loaded, type) else loaded
    if not isinstance(backend, Backend):
        raise LookupError(f"backend {name!r} ({found[0].value}) is not a hatch_aoti.backends.Backend")
    return backend


def combined_pins(pins: list[Pins]) -> Pins:
    """The narrowest requirement across a wheel's models: an exact torch pin wins over a series."""
    exact = [p.torch for p in pins if "==" in p.torch and "*" not in p.torch and "," not in p.torch]
    tags = sorted({p.python_tag for p in pins} - {"py3"})
    if len(tags) > 1:
        raise ValueError(f"the models need different Pythons ({', '.join(tags)}); build them in separate wheels")
    return Pins(exact[0] if exact else pins[0].torch, tags[0] if tags else "py3")
