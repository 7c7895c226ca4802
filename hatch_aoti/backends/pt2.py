"""A ``.pt2`` unpacked into the files the wheel ships (``<package>/_aoti/<model>/...``).

The runtime cannot ``dlopen`` a library inside a zip, and torch's own loader extracts the
whole archive to a temporary directory on every load; unpacked, the loader maps the library
in place and writes nothing. The loader's ``save_pt2()`` zips the same files back.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

from hatch_aoti.pipeline.artifacts import sha256

#: Archive members the runtime never reads: generated C++ sources (they hold build paths)
#: and a random per-archive id. Leaving them out keeps wheels smaller and reproducible.
SKIPPED_SUFFIXES = (".cpp", "/.data/serialization_id")
#: Small text members (format markers, metadata JSON) are kept in the manifest rather
#: than as files: they are the same in every model, and identical files in a wheel are
#: a packaging smell (check-wheel-contents W002).
INLINE_LIMIT = 16 * 1024
#: Where Inductor pickles weights kept out of the library, and how it names them.
WEIGHTS_DIR = "data/weights/"
WEIGHTS_CONFIG = "weights_config.json"
WEIGHTS_FILE = "weights.bin"
#: Every tensor in ``weights.bin`` starts at a multiple of this (vector loads, any dtype).
WEIGHTS_ALIGNMENT = 64


def unpack_pt2(pt2: Path, target: Path) -> dict[str, Any]:
    """Unpack one model's ``.pt2`` into ``target``; describe what the loader needs (paths relative to it).

    Weights kept out of the library (one pickled file each) go into one file, ``weights.bin``,
    that the loader maps (see :func:`write_weights`). Files get fixed modes, so that the
    wheel's bytes do not depend on the builder's umask.
    """
    if target.exists():
        shutil.rmtree(target)
    members: list[str] = []
    inline: dict[str, str] = {}
    weights: list[zipfile.ZipInfo] = []
    config: zipfile.ZipInfo | None = None
    with zipfile.ZipFile(pt2) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            _, _, rest = info.filename.partition("/")
            if not rest or ".." in Path(rest).parts:
                raise ValueError(f"unexpected member {info.filename!r} in {pt2.name}")
            if info.filename.endswith(SKIPPED_SUFFIXES):
                continue
            members.append(rest)
            if rest.startswith(WEIGHTS_DIR):
                weights.append(info)
                continue
            if rest.endswith(WEIGHTS_CONFIG):  # the loader writes it again from the weights index
                config = info
                continue
            if info.file_size <= INLINE_LIMIT and not rest.endswith(".so"):
                try:
                    inline[rest] = archive.read(info).decode("utf-8")
                    continue
                except UnicodeDecodeError:
                    pass
            dest = target / rest
            dest.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, dest.open("wb") as out:
                shutil.copyfileobj(src, out)
            dest.chmod(0o755 if rest.endswith(".so") else 0o644)
        entry: dict[str, Any] = {"members": members, "inline": inline}
        if weights:
            if config is None:
                raise ValueError(f"{pt2.name} has weights but no {WEIGHTS_CONFIG}")
            entry["weights"] = write_weights(archive, weights, json.loads(archive.read(config)), target)
        elif config is not None:  # no weights to write it again from: kept as it came
            inline[config.filename.partition("/")[2]] = archive.read(config).decode("utf-8")
    libraries = sorted(m for m in members if m.startswith("data/aotinductor/") and m.endswith(".so"))
    if len(libraries) != 1:
        raise ValueError(f"expected one compiled library in {pt2.name}, found {libraries or 'none'}")
    from hatch_aoti.pipeline.tagging import torch_symbols

    library = target / libraries[0]
    return {"file": libraries[0], "sha256": sha256(library), "torch_symbols": torch_symbols(library), **entry}


def write_weights(
    archive: zipfile.ZipFile, members: list[zipfile.ZipInfo], config: dict[str, Any], target: Path
) -> dict[str, Any]:
    """Put the weights Inductor pickled one file each into ``weights.bin``, each at an aligned offset.

    The loader maps that file and hands views of it to the library, so the weights are
    read from the page cache and shared between processes instead of copied into each.
    One pickled file holds one storage, which several constants may view (Inductor groups
    weights that share storage); each constant keeps its own shape, stride and offset.
    The bytes are copied in chunks, never held whole; the index says where each view is.
    """
    import tempfile

    import torch

    views: dict[str, list[tuple[str, Any]]] = {}
    for constant, (file, shape, stride, storage_offset) in config.items():
        views.setdefault(file, []).append(
            (constant, {"shape": shape, "stride": stride, "storage_offset": storage_offset})
        )
    index: dict[str, Any] = {}
    with (target / WEIGHTS_FILE).open("wb") as blob, tempfile.TemporaryDirectory() as tmp:
        for number, info in enumerate(members):
            file = info.filename.rsplit("/", 1)[1]
            pickled = Path(tmp) / f"weight-{number}"  # one file each: torch may keep a mapped file open
            with archive.open(info) as src, pickled.open("wb") as out:
                shutil.copyfileobj(src, out)
            tensor = torch.load(pickled, mmap=True, weights_only=True)  # metadata only: nothing is read
            blob.write(b"\0" * (-blob.tell() % WEIGHTS_ALIGNMENT))
            storage = {
                "file": file,
                "offset": blob.tell(),
                "nbytes": tensor.untyped_storage().nbytes(),
                "dtype": str(tensor.dtype).removeprefix("torch."),
            }
            del tensor
            for constant, view in views.pop(file, []):
                index[constant] = {**storage, **view}
            with zipfile.ZipFile(pickled) as inner:
                (data,) = [n for n in inner.namelist() if n.split("/")[-2:-1] == ["data"]]
                with inner.open(data) as src:
                    shutil.copyfileobj(src, blob, 1 << 20)
            pickled.unlink()
    if views:
        raise ValueError(f"{WEIGHTS_CONFIG} names weight files the package lacks: {sorted(views)}")
    (target / WEIGHTS_FILE).chmod(0o644)
    return {"file": WEIGHTS_FILE, "sha256": sha256(target / WEIGHTS_FILE), "tensors": index}
