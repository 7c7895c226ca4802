"""Lay out compiled artifacts and the loader the way the wheel ships them.

A ``.pt2`` is a zip; the runtime cannot ``dlopen`` a library inside a zip, and torch's
own loader extracts the whole archive to a temp dir on every load. So the wheel ships
the archive's files unpacked (``<package>/_aoti/<model>/...``): the loader maps the
shared library in place and writes nothing. The loader's ``save_pt2()`` zips the same
files back into a standard package for people who deploy elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

ARTIFACT_DIR = "_aoti"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2
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


def template_path(name: str = "compiled.py") -> Path:
    """A template, shipped as ``hatch_aoti/templates`` (or ``templates/`` in a checkout)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "templates" / name, here.parent / "templates" / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"hatch-aoti is installed without its template templates/{name}")


def editable_finder(module: str, file: str) -> str:
    """Source of the finder that maps ``module`` to ``file`` (relative to site-packages)."""
    text = template_path("editable_finder.py").read_text(encoding="utf-8")
    return text.replace("{{module}}", module).replace("{{file}}", file)


def write_runtime(package_dir: Path, backend: str, source: Path) -> None:
    """Ship a backend's run-time module as ``_aoti/runtime/<backend>.py`` (see ``hatch_aoti.backends``)."""
    dest = package_dir / ARTIFACT_DIR / "runtime" / f"{backend}.py"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    dest.chmod(0o644)


def editable_files(package: str, loader: str, staged: Path, stage: Path) -> dict[Path, str]:
    """What an editable install adds to site-packages, by source: the staged package as
    ``_hatch_aoti_<package>/``, and a ``.pth``-imported finder mapping ``<package>.<loader>`` there."""
    home = f"_hatch_aoti_{package.replace('.', '_')}"
    finder = stage / f"{home}_finder.py"
    finder.write_text(editable_finder(f"{package}.{loader}", f"{home}/{loader}.py"), encoding="utf-8")
    pth = stage / f"{home}.pth"
    pth.write_text(f"import {home}_finder\n", encoding="utf-8")
    return {staged: home, finder: finder.name, pth: pth.name}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(directory: Path, known: dict[str, str]) -> dict[str, str]:
    """sha256 of every file under ``directory`` by relative path (``known`` ones not read again):
    what ``hatch-aoti verify`` checks an installed model's files against."""
    return {rel: known.get(rel) or sha256(directory / rel)
            for rel in sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())}  # fmt: skip


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
        entry = {"members": members, "inline": inline}
        if weights:
            entry["weights"] = write_weights(archive, weights, inline, target)
    libraries = sorted(m for m in members if m.startswith("data/aotinductor/") and m.endswith(".so"))
    if len(libraries) != 1:
        raise ValueError(f"expected one compiled library in {pt2.name}, found {libraries or 'none'}")
    from hatch_aoti.platform_tag import torch_symbols

    library = target / libraries[0]
    return {"file": libraries[0], "sha256": sha256(library), "torch_symbols": torch_symbols(library), **entry}


def write_weights(archive: zipfile.ZipFile, members: list[zipfile.ZipInfo], inline: dict[str, str],
                  target: Path) -> dict[str, Any]:  # fmt: skip
    """Put the weights Inductor pickled one file each into ``weights.bin``, each at an aligned offset.

    The loader maps that file and hands views of it to the library, so the weights are
    read from the page cache and shared between processes instead of copied into each.
    The bytes are copied in chunks, never held whole; the index says where each tensor is.
    """
    import tempfile

    import torch

    (config_name,) = [n for n in inline if n.endswith(WEIGHTS_CONFIG)]
    by_file = {v[0]: fqn for fqn, v in json.loads(inline[config_name]).items()}
    index: dict[str, Any] = {}
    with (target / WEIGHTS_FILE).open("wb") as blob, tempfile.TemporaryDirectory() as tmp:
        for number, info in enumerate(members):
            pickled = Path(tmp) / f"weight-{number}"  # one file each: torch may keep a mapped file open
            with archive.open(info) as src, pickled.open("wb") as out:
                shutil.copyfileobj(src, out)
            tensor = torch.load(pickled, mmap=True, weights_only=True)  # metadata only: nothing is read
            blob.write(b"\0" * (-blob.tell() % WEIGHTS_ALIGNMENT))
            index[by_file[info.filename.rsplit("/", 1)[1]]] = {
                "offset": blob.tell(),
                "nbytes": tensor.untyped_storage().nbytes(),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "stride": list(tensor.stride()),
                "storage_offset": tensor.storage_offset(),
            }
            del tensor
            with zipfile.ZipFile(pickled) as inner:
                (data,) = [n for n in inner.namelist() if n.split("/")[-2:-1] == ["data"]]
                with inner.open(data) as src:
                    shutil.copyfileobj(src, blob, 1 << 20)
            pickled.unlink()
    (target / WEIGHTS_FILE).chmod(0o644)
    return {"file": WEIGHTS_FILE, "sha256": sha256(target / WEIGHTS_FILE), "tensors": index}


def write_loader(package_dir: Path, loader: str, manifest: dict[str, Any]) -> None:
    """Write ``<loader>.py`` and ``_aoti/manifest.json`` into a staged package directory."""
    (package_dir / ARTIFACT_DIR).mkdir(parents=True, exist_ok=True)
    # Models stay in declaration order (``names()``); everything else is sorted, so an
    # entry reads the same whether it was just compiled or came from the cache.
    models = {name: json.loads(json.dumps(entry, sort_keys=True)) for name, entry in manifest["models"].items()}
    text = json.dumps({"format": MANIFEST_FORMAT, **manifest, "models": models}, indent=2) + "\n"
    (package_dir / ARTIFACT_DIR / MANIFEST).write_text(text, encoding="utf-8")
    shutil.copyfile(template_path(), package_dir / f"{loader}.py")
    for written in (package_dir / ARTIFACT_DIR / MANIFEST, package_dir / f"{loader}.py"):
        written.chmod(0o644)
