"""The backend interface: what a backend is given and what it returns.

Imported by the build backend (for :meth:`Backend.check` and :meth:`Backend.pins`) and by the
worker (for :meth:`Backend.compile`): a backend module must not import torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from hatch_aoti.settings.cpu_targets import CpuTarget
    from hatch_aoti.settings.spec import ModelSpec

#: One call's inputs: positional and keyword arguments.
Sample = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Pins:
    """What a wheel holding a backend's artifacts must require of the machine that installs it."""

    torch: str
    """``Requires-Dist`` on torch, e.g. ``torch==2.13.*``."""
    python_tag: str = "py3"
    """The wheel's interpreter tag: ``py3``, or ``cpXY`` for artifacts tied to one Python."""


@dataclass
class InputPlan:
    """What export and verification need: samples, dims and a plain description."""

    export_sample: Sample
    verify_samples: list[tuple[str, Sample]]
    """(label, sample) pairs; the label says which sizes were tried."""
    dynamic_shapes: dict[str, Any] | None
    """Keyed by ``forward`` parameter name, as ``torch.export.export`` accepts."""
    dims: dict[str, tuple[int, int | None]]
    """Named dynamic dims and their (min, max) as built."""
    description: dict[str, Any]
    """JSON-safe input description kept in the artifact's metadata."""
    axis_names: list[dict[int, str]]
    """Per tensor input, in flattening order: dim names by axis."""
    rules: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """Derived dims: ``samples = 320*frames`` is ``{"samples": ("frames", 320, 0)}``."""
    values: list[tuple[float | None, float | None]] = field(default_factory=list)
    """Per tensor input: the (low, high) of generated values, ``None`` for the generator's default."""
    seed: int | None = None
    """The seed :mod:`hatch_aoti.worker.generate` made the verification samples from; ``None`` for the project's own."""


@dataclass(frozen=True)
class ProgramFacts:
    """What the build learns of a model once it is exported, from its exported program: facts, not
    settings (the worker makes them: :func:`hatch_aoti.worker.facts.program_facts`). The defaults
    say that nothing is known."""

    weights_bytes: int | None = None
    """Bytes of the exported program's weights and constants (the size-based defaults use it)."""
    repackable: bool = True
    """Whether the weights Inductor packs for oneDNN can ship dense (see ``aoti.fast_defaults``)."""
    weighted_macs: int | None = None
    """Mean multiply-adds of the exported program's matrix products by a weight, at the example
    inputs' sizes (a model exported at batch 1 counts batch 1)."""
    weighted_products: int = 0
    """How many matrix products by a weight the exported program has (those ``weighted_macs`` counts)."""
    convolutions: int = 0
    """How many convolutions by a weight the exported program has (those gain from packing at any size)."""


@dataclass
class Request:
    """One model to compile, as the coordinator (or a compile helper) has it."""

    name: str
    exported: torch.export.ExportedProgram
    """The exported program the cache key was computed from."""
    settings: dict[str, Any]
    """What :meth:`Backend.settings` returned for this model."""
    out: Path
    """Directory that receives the model's files (``_aoti/<model>/`` in the wheel)."""
    work: Path
    """Scratch directory, emptied by the caller."""
    module: torch.nn.Module | None = None
    """The eager ``nn.Module`` (``None`` in compile helpers: see :attr:`Backend.in_helpers`)."""
    plan: InputPlan | None = None
    """The model's :class:`InputPlan`: example inputs and dynamic dims."""
    loader: str = ""
    """Import name the generated loader has at run time (``my_pkg.compiled``)."""
    factory: str = ""
    """``module:attr`` of the model's factory."""
    spec: ModelSpec | None = None
    """The model's :class:`hatch_aoti.settings.spec.ModelSpec` (its ``dynamic`` table as declared, say)."""
    facts: ProgramFacts | None = None
    """What :attr:`exported` says of the model (its weights' size, say)."""


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

    def settings(
        self, user_configs: dict[str, Any], cpu: CpuTarget, spec: ModelSpec, facts: ProgramFacts
    ) -> dict[str, Any]:
        """The settings a model compiles with (shown by ``info()`` and part of the cache key).

        ``user_configs`` are the model's ``inductor-configs``, ``cpu`` its resolved CPU
        target, ``spec`` its :class:`hatch_aoti.settings.spec.ModelSpec`, ``facts`` what its
        exported program says of it.
        """
        return dict(user_configs)

    def key(self) -> dict[str, Any]:
        """Anything else the artifact depends on, for the cache key."""
        return {}

    def check(self, spec: ModelSpec) -> list[tuple[str, str]]:
        """Problems with a model this backend cannot compile, by TOML path, found before exporting."""
        return []

    def compile(self, request: Request) -> dict[str, Any]:
        """Write the model's files into ``request.out``; return the manifest entry's fields about them.

        The fields must include ``file`` (the main file, relative to ``request.out``) and
        ``sha256`` (of that file). Raise any exception for a failed compile.
        """
        raise NotImplementedError

    def pins(self, torch_version: str) -> Pins:
        from hatch_aoti.pipeline.tagging import torch_series

        return Pins(torch_series(torch_version))
