"""The manifest's schema: what the build writes into ``_aoti/manifest.json`` and this loader reads.

Defined here, once: the build types its writer and its checks against these classes, and the
loader refuses a manifest of a format it does not know before it reads anything else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, TypedDict

ARTIFACT_DIR = "_aoti"
"""The folder beside the loader that holds the manifest and each model's files."""
MANIFEST = "manifest.json"
FORMAT = 2
"""The manifest format this loader reads; a build writes this one."""
PRECISIONS = ("float32", "bfloat16", "int8")
"""The precisions a model's variants are built in: ``float32`` is the model as its factory returns it."""
PRECISION_VARIABLE = "HATCH_AOTI_PRECISION"
"""Names the variant ``load()`` takes of every model, where it is set."""


def variant_name(model: str, precision: str) -> str:
    """The folder (under ``_aoti``) of one variant of a model: the model's own name for ``float32``."""
    return model if precision == "float32" else f"{model}@{precision}"


def precision_of(entry: Mapping[str, Any]) -> str:
    """An entry's precision: ``float32`` where it names none (a manifest's checks see what else it names)."""
    precision: str = entry.get("precision", "float32")
    return precision


def variants_of(entry: Entry) -> list[Entry]:
    """A model's variants, in the order of preference the build was given: the entry, then the others."""
    return [entry, *entry.get("variants", [])]


def folder_of(model: str, entry: Entry) -> str:
    """The folder of one variant's files, by its entry."""
    return variant_name(model, precision_of(entry))


class Dim(TypedDict, total=False):
    """A dynamic axis: its range, and for a derived dim its root, multiple and offset."""

    name: str
    min: int
    max: int | None
    root: str
    mult: int
    offset: int


class Leaf(TypedDict, total=False):
    """What one flattened input must be: a tensor's dtype, device and shape, or a constant."""

    dtype: str
    device: str
    shape: list[int | Dim]
    mutated: bool
    index_rows: int
    low: float | None
    high: float | None
    """The range the build generated the input's values in (integers: ``[low, high)``)."""
    const: Any
    check_const: bool


class Output(TypedDict, total=False):
    """One flattened output: a tensor, a number of a type, or a constant; ``view_of`` an input."""

    kind: str
    value: Any
    view_of: int


class Parameter(TypedDict, total=False):
    """One parameter of ``forward``, for calls laid out as ``forward`` takes them."""

    name: str
    kind: str
    default: Any
    opaque_default: bool


class Place(TypedDict):
    """Where one constant lies in the weights file."""

    file: str
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int
    offset: int
    nbytes: int


class External(TypedDict):
    """``weights = "external"``: the file's name in the cache, its URL template and its size."""

    url: str
    file: str
    size: int


class Weights(TypedDict, total=False):
    file: str
    sha256: str
    tensors: dict[str, Place]
    external: External


class Packing(TypedDict):
    """A weight the loader packs for this CPU: the packing op (``namespace::name``, one of ``packing.OPS``)
    and its other arguments, each a JSON value, ``{"constant": name}`` (another of the model's weights) or
    ``{"values": [...], "dtype": name}`` (a small tensor, which the library holds in its code)."""

    op: str
    args: list[Any]


class Region(TypedDict):
    """A precompiled function and the sizes it covers, by root dim."""

    file: str
    sha256: str
    dims: dict[str, list[int | None]]


class Cpu(TypedDict):
    arch: str
    target: str
    features: list[str]


class Entry(TypedDict, total=False):
    """One model. ``call``, ``cpu``, ``device`` and ``file`` are always there (the build checks);
    the rest depends on the backend and the model."""

    call: list[Leaf]
    cpu: Cpu
    device: str
    file: str
    sha256: str
    backend: str
    factory: str
    call_spec: list[str]
    signature: list[Parameter]
    outputs: list[Output]
    verification: dict[str, Any]
    inductor_configs: dict[str, Any]
    files: dict[str, str]
    sizes: dict[str, int]
    torch_symbols: list[str]
    members: list[str]
    """The ``.pt2`` package's members, for ``save_pt2()``."""
    inline: dict[str, str]
    """Its small text members, kept here rather than as files."""
    weights: Weights
    packing: dict[str, Packing]
    regions: list[Region]
    python: str
    torch: str
    tuning: dict[str, Any]
    """``tune = true``: each candidate's time or why it was dropped, and the one kept."""
    precision: str
    """One of :data:`PRECISIONS` (``float32`` where absent); its files are in :func:`variant_name`'s folder."""
    variants: list[Entry]
    """The model's other variants, in the order of preference the build was given (the first is this one)."""
    quantized: str
    """``int8``: what was quantized, as the build log said it."""
    uses: list[str]
    """Precisions besides its own whose native arithmetic the variant needs (an int8 variant's
    convolutions compute in bfloat16 where it had no calibration samples and bfloat16 came next)."""


class Manifest(TypedDict):
    format: int
    hatch_aoti: str
    torch: str
    package: str
    loader: str
    models: dict[str, Entry]


def read(directory: str) -> Manifest:
    """The manifest in ``directory`` (the package's ``_aoti``); a manifest of another format is refused
    with what to do, since its fields may mean something else."""
    path = os.path.join(directory, MANIFEST)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        writer = data.get("hatch_aoti") if isinstance(data, dict) else None
        by = f" (written by hatch-aoti {writer})" if isinstance(writer, str) else ""
        newer = isinstance(found, int) and found > FORMAT
        raise RuntimeError(
            f"{path} is of manifest format {found!r}{by}; this loader reads format {FORMAT}: "
            + (
                "a newer hatch-aoti wrote it; read it with that hatch-aoti or a later one"
                if newer
                else "reinstall the package"
            )
        )
    manifest: Manifest = data
    return manifest
