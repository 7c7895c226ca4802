"""A model's weights file, mapped (page cache, shared between processes): shipped in the wheel, or
fetched once into a per-user cache (:mod:`.external`, imported only for such models)."""

from __future__ import annotations

import os
from typing import Any

from .schema import Entry, Place


def mapped(
    torch: Any,
    name: str,
    entry: Entry,
    directory: str,
    constants: dict[str, str],
    places: dict[str, Place] | None = None,
) -> dict[str, Any]:
    """Views of the model's ``weights.bin``, mapped (page cache, shared between processes), by constant
    name; ``constants`` maps each to its name in the weights index (or in ``places``)."""
    weights = entry["weights"]
    places = weights["tensors"] if places is None else places
    path = file_path(name, entry, directory)
    blob = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
    views = {}
    for constant, fqn in constants.items():
        t = places[fqn]
        data = blob[t["offset"] : t["offset"] + t["nbytes"]].view(getattr(torch, t["dtype"]))
        # as_strided counts its offset from the start of the file, in elements of the dtype
        views[constant] = data.as_strided(
            t["shape"], t["stride"], t["offset"] // data.element_size() + t["storage_offset"]
        )
    return views


def file_path(name: str, entry: Entry, directory: str) -> str:
    """The weights file to map: the one shipped beside the library, or an external one, fetched if needed."""
    weights = entry["weights"]
    if "external" not in weights:
        return os.path.join(directory, weights["file"])
    from .external import fetched

    return fetched(name, weights)
