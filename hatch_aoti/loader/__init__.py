"""Ahead-of-time compiled models of this package.

Written by hatch-aoti when the wheel was built. It needs only ``torch`` and the standard
library: the models were exported and compiled with AOTInductor when the wheel was built,
and checked against the eager models then.

    from <package> import compiled
    compiled.names()                 # names of the compiled models
    model = compiled.load("name")    # loaded once, then shared; thread-safe
    outputs = model(*args, **kwargs)
    compiled.info("name")            # build metadata: torch version, inputs, checks, ...
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

from .schema import ARTIFACT_DIR, Entry, Manifest
from .schema import read as read_manifest

__all__ = ["fetch", "info", "load", "names", "save_pt2"]

#: The package's ``_aoti`` folder: the manifest, and each model's files in a folder of its name.
_ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ARTIFACT_DIR)
_LOCK = threading.Lock()
_LOADED: dict[str, Callable[..., Any]] = {}
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


def info(name: str) -> dict[str, Any]:
    """Build metadata of one model (a fresh dict; changing it changes nothing)."""
    entry: dict[str, Any] = json.loads(json.dumps(_entry(name)))
    entry["file"] = os.path.join(_ARTIFACTS, name, entry["file"])
    entry["torch"] = _manifest()["torch"]
    entry["hatch_aoti"] = _manifest()["hatch_aoti"]
    if "external" in entry.get("weights", {}):
        from .external import state

        entry["weights_source"] = state(name, _entry(name))
    return entry


def load(name: str) -> Callable[..., Any]:
    """The compiled model ``name``, loaded on first use and shared afterwards."""
    model = _LOADED.get(name)
    if model is not None:
        return model
    entry = _entry(name)
    with _LOCK:
        model = _LOADED.get(name)
        if model is None:
            from .calls import aoti_call, checked_call
            from .engine import Model

            built = Model(name, entry, _ARTIFACTS, _manifest()["torch"])
            model = _LOADED[name] = aoti_call(built) if built.backend == "aoti" else checked_call(built)
    return model


def save_pt2(name: str, path: str) -> str:
    """Write model ``name`` as a standard ``.pt2`` package (``aoti_load_package``, C++).

    A model with mapped weights keeps them beside its library there too: load that package
    with ``torch.export.pt2_archive._package.load_pt2(path, load_weights_from_disk=True)``.
    """
    from .pt2 import write

    entry = _entry(name)
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "wb") as f:
            write(name, entry, os.path.join(_ARTIFACTS, name), f)
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)
    return path


def fetch(*models: str) -> dict[str, str]:
    """Fetch and verify the external weights of ``models`` (all that have them, if none are named); their paths."""
    from .external import fetched

    found = {}
    for name in models or [n for n, e in _manifest()["models"].items() if "external" in e.get("weights", {})]:
        weights = _entry(name).get("weights", {})
        if "external" in weights:
            found[name] = fetched(name, weights)
    return found
