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
    blob = _blob(torch, name, entry, directory)
    views = {}
    for constant, fqn in constants.items():
        t = places[fqn]
        data = blob[t["offset"] : t["offset"] + t["nbytes"]].view(getattr(torch, t["dtype"]))
        # as_strided counts its offset from the start of the file, in elements of the dtype
        views[constant] = data.as_strided(
            t["shape"], t["stride"], t["offset"] // data.element_size() + t["storage_offset"]
        )
    return views


def _blob(torch: Any, name: str, entry: Entry, directory: str) -> Any:
    """The whole weights file, mapped. An external one is mapped through the very open file that was
    verified (``/proc/self/fd/N`` opens that file again, not whatever its name points to now), so a file
    renamed onto the cache's path after the check is never the one mapped."""
    weights = entry["weights"]
    if "external" not in weights:
        path = os.path.join(directory, weights["file"])
        return torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
    from .external import opened

    fd = opened(name, weights)
    try:
        through = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"
        return torch.from_file(through, shared=False, size=os.fstat(fd).st_size, dtype=torch.uint8)
    finally:
        os.close(fd)
