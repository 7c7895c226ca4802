"""Ahead-of-time compiled models of this package.

Written by hatch-aoti when the wheel was built. It needs only ``torch`` and the standard
library: the models were exported and compiled with AOTInductor when the wheel was built,
and checked against the eager models then.

    from <package> import compiled
    compiled.names()                 # names of the compiled models
    model = compiled.load("name")    # loaded once, then shared; thread-safe
    outputs = model(*args, **kwargs)
    compiled.load("name", precision="float32")   # a variant of the model by name (see info())
    compiled.info("name")            # build metadata: the precision that loads here, inputs, checks, ...
    compiled.save_pt2("name", "model.pt2")   # a standard AOTInductor package, e.g. for C++
    compiled.fetch()                 # external weights, fetched and verified beforehand

The functions above are the whole API. The modules beside this one each hold one concern of a
load or a call, and are imported only when a model needs them.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

from .schema import ARTIFACT_DIR, PRECISION_VARIABLE, Entry, Manifest, folder_of, precision_of, variants_of
from .schema import read as read_manifest

__all__ = ["fetch", "info", "load", "names", "save_pt2"]

#: The package's ``_aoti`` folder: the manifest, and each model's files in a folder of its name.
_ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ARTIFACT_DIR)
_LOCK = threading.Lock()
_LOADED: dict[tuple[str, str | None], Callable[..., Any]] = {}
_MANIFEST: list[Manifest] = []


def _manifest() -> Manifest:
    """The manifest, read on first use (its format checked first)."""
    if not _MANIFEST:
        _MANIFEST.append(read_manifest(_ARTIFACTS))
    return _MANIFEST[0]


def names() -> tuple[str, ...]:
    """Names of the compiled models, in declaration order."""
    return tuple(_manifest()["models"])


def _entry(name: str) -> Entry:
    models = _manifest()["models"]
    try:
        return models[name]
    except (KeyError, TypeError):
        known = ", ".join(repr(n) for n in models) or "none"
        raise KeyError(f"no compiled model {name!r} in {__name__}; known models: {known}") from None


def _variant(name: str, precision: str | None, *, refuse: bool = True) -> tuple[Entry | None, dict[str, str]]:
    """The variant of ``name`` that loads here (``precision``, else ``HATCH_AOTI_PRECISION``, else the first
    this CPU runs natively, as the CPU itself tells torch), and why each one before it was passed over;
    ``None`` where none runs here and ``refuse`` is false."""
    import torch

    from .host import ENVIRONMENT, choose

    entry = _entry(name)
    wanted = precision or os.environ.get(ENVIRONMENT) or None
    try:
        return choose(name, entry, wanted, torch, refuse=refuse)
    except (LookupError, ValueError, RuntimeError) as exc:
        if precision is None and wanted is not None:  # say where the choice came from
            raise type(exc)(f"{exc} ({ENVIRONMENT}={wanted})") from None
        raise


def info(name: str, precision: str | None = None) -> dict[str, Any]:
    """Build metadata of the variant of one model that loads here (a fresh dict; changing it changes nothing):
    ``precision`` names it, ``passed_over`` says why each variant listed before it does not load here."""
    found, passed = _variant(name, precision, refuse=False)
    chosen = found or _entry(name)  # none runs here: the first, with why not in `passed_over`
    entry: dict[str, Any] = json.loads(json.dumps({k: v for k, v in chosen.items() if k != "variants"}))
    entry["precision"] = precision_of(chosen) if found is not None else None
    entry["variants"] = [precision_of(v) for v in variants_of(_entry(name))]
    entry["passed_over"] = passed
    entry["file"] = os.path.join(_ARTIFACTS, folder_of(name, chosen), entry["file"])
    entry["torch"] = _manifest()["torch"]
    entry["hatch_aoti"] = _manifest()["hatch_aoti"]
    if "external" in entry.get("weights", {}):
        from .external import state

        entry["weights_source"] = state(name, chosen)
    return entry


def load(name: str, precision: str | None = None) -> Callable[..., Any]:
    """The compiled model ``name``, loaded on first use and shared afterwards: the first of its variants
    this CPU runs natively, or the one ``precision`` (or ``HATCH_AOTI_PRECISION``) names."""
    key = (name, precision or os.environ.get(PRECISION_VARIABLE) or None)  # None: chosen for this CPU
    model = _LOADED.get(key)
    if model is not None:
        return model
    _entry(name)
    with _LOCK:
        model = _LOADED.get(key)
        if model is None:
            from .calls import aoti_call, checked_call
            from .engine import Model

            entry, _ = _variant(name, precision)
            assert entry is not None
            same = (name, precision_of(entry))  # one copy, however the variant was asked for
            model = _LOADED.get(same)
            if model is None:
                built = Model(name, entry, _ARTIFACTS, _manifest()["torch"])
                model = aoti_call(built) if built.backend == "aoti" else checked_call(built)
            _LOADED[key] = _LOADED[same] = model
    return model


def save_pt2(name: str, path: str, precision: str | None = None) -> str:
    """Write model ``name`` (the variant that loads here, or ``precision``'s) as a standard ``.pt2`` package
    (``aoti_load_package``, C++).

    A model with mapped weights keeps them beside its library there too: load that package
    with ``torch.export.pt2_archive._package.load_pt2(path, load_weights_from_disk=True)``. An int8
    variant cannot be saved: its weights are packed as it loads, which torch's own loader does not do.
    """
    from .packing import runs_dense
    from .pt2 import write

    entry, _ = _variant(name, precision)
    assert entry is not None
    if not runs_dense(entry):
        raise ValueError(
            f"compiled model {name!r}: its {precision_of(entry)} variant's weights are packed for this CPU as "
            "it loads, which torch's own loader does not do; save another of its variants (`precision=`)"
        )
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "wb") as f:
            write(name, entry, os.path.join(_ARTIFACTS, folder_of(name, entry)), f)
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)
    return path


def fetch(*models: str) -> dict[str, str]:
    """Fetch and verify the external weights of ``models`` (all that have them, if none are named), of the
    variant of each that loads here; their paths."""
    from .external import fetched

    found = {}
    for name in models or [n for n in names() if any(_external(v) for v in variants_of(_entry(n)))]:
        entry, _ = _variant(name, None)
        assert entry is not None
        if _external(entry):
            found[name] = fetched(name, entry["weights"])
    return found


def _external(entry: Entry) -> bool:
    return "external" in entry.get("weights", {})
