"""What the build works from: each model's settings resolved against the table's, and the whole table.

Settings only: what the build learns of a model once it is exported is its
:class:`hatch_aoti.backends.interface.ProgramFacts`. A spec crosses to the coordinator as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hatch_aoti.loader.schema import variant_name
from hatch_aoti.settings.constants import HATCH_TABLE, PORTABLE
from hatch_aoti.settings.model import DimSpec, TensorSpec


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
    """As written until the model is exported; then ``auto`` is what the weights' size chose."""
    path: str = ""
    """Full TOML path of the model's table, for messages."""
    weights_url: str | None = None
    """``weights = "external"``: the URL template of the weights file."""
    tune: bool = False
    """Compile candidate settings and keep the fastest that verifies (the model's own, or the table's)."""
    optimize: str = PORTABLE
    """``host``: compiled for the build machine's CPU (the model's own, or the table's)."""
    precision: tuple[str, ...] = ("float32",)
    """The variants to build, in order of preference (the model's own, or the table's)."""
    calibration: str | None = None
    """``int8``: ``"module:attr"`` of the samples convolutions are calibrated on."""
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)
    """Limits of each lower precision's check (``rel_error``, ``cosine``), where the user set them."""

    @property
    def variants(self) -> list[tuple[str, str]]:
        """Each variant's name (its folder, and its name in the build's progress) and precision."""
        return [(variant_name(self.name, p), p) for p in self.precision]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSpec:
        data = dict(data)
        data["precision"] = tuple(data["precision"])
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
