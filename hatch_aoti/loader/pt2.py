"""A model as a standard ``.pt2`` package (``save_pt2()``), and torch's own runner on one: the fallback
for a torch that lacks the runner the loader uses."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from typing import IO, Any, BinaryIO, cast

from .schema import Entry, Place
from .weights import mapped


def write(name: str, entry: Entry, directory: str, f: BinaryIO) -> None:
    """The standard ``.pt2`` archive: shipped files, the small members kept in the manifest, and
    the weights pickled one file each again, as torch's own loader reads them."""
    import zipfile

    inline = entry["inline"]
    pickled = pickled_weights(name, entry, directory) if "weights" in entry else {}
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
        for member in entry["members"]:
            info = zipfile.ZipInfo(f"{name}/{member}", date_time=(1980, 1, 1, 0, 0, 0))
            if member in inline:
                archive.writestr(info, inline[member].encode("utf-8"))
            elif member in pickled:
                with archive.open(info, "w", force_zip64=True) as out:
                    pickled[member](out)
            else:
                with (
                    open(os.path.join(directory, member), "rb") as src,
                    archive.open(info, "w", force_zip64=True) as out,
                ):
                    while chunk := src.read(1 << 24):
                        out.write(chunk)


def pickled_weights(name: str, entry: Entry, directory: str) -> dict[str, Callable[[IO[bytes]], None]]:
    """Writers of the weights as Inductor's package format has them, by member: one ``torch.save`` file
    per storage (the whole storage, which several constants may view) and the config that says where
    each constant is in it. Each writer copies one storage at a time, so a large package is not held whole."""
    import torch

    tensors = entry["weights"]["tensors"]
    whole = {"dtype": "uint8", "stride": [1], "storage_offset": 0}
    storages = {t["file"]: cast(Place, {**t, **whole, "shape": [t["nbytes"]]}) for t in tensors.values()}
    blob = mapped(torch, name, entry, directory, {file: file for file in storages}, storages)
    config = {c: [t["file"], t["shape"], t["stride"], t["storage_offset"]] for c, t in tensors.items()}

    dtypes = {t["file"]: getattr(torch, t["dtype"]) for t in tensors.values()}

    def writer(file: str) -> Callable[[IO[bytes]], None]:  # the storage's bytes as its own dtype again
        return lambda out: torch.save(blob[file].clone().view(dtypes[file]), out)

    (config_member,) = [m for m in entry["members"] if m.endswith("weights_config.json")]
    writers = {f"data/weights/{file}": writer(file) for file in storages}

    def write_config(out: IO[bytes]) -> None:
        out.write(json.dumps(config).encode("utf-8"))

    writers[config_member] = write_config
    return writers


def public_runner(name: str, entry: Entry, directory: str) -> Any:
    """torch's own loader on the same files, rebuilt as a ``.pt2`` in memory."""
    from torch.export.pt2_archive._package import load_pt2

    archive = io.BytesIO()
    write(name, entry, directory, archive)
    archive.seek(0)
    (runner,) = load_pt2(archive, load_weights_from_disk="weights" in entry).aoti_runners.values()
    return runner
