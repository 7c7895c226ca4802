"""``weights = "external"``: a model's weights file leaves the wheel for a directory of files to upload.

The file is the one the build verified, byte for byte, named by its sha256; the manifest
records where it is served, its size and its digest, and the loader fetches it at first load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from hatch_aoti.loader.schema import folder_of, variants_of
from hatch_aoti.pipeline import manifest
from hatch_aoti.pipeline.artifacts import ARTIFACT_DIR
from hatch_aoti.settings.spec import ModelSpec, Settings

#: A package index's default limit per file (PyPI's): above it, the build says how to stay under.
INDEX_LIMIT = 100 * 10**6


class NotWritten(Exception):
    """A weights file could not be written where it goes; the message says where and what is needed."""


def weights_dir(settings: Settings, root: Path, output: Path | None) -> Path:
    """``weights-dir``: relative to the directory that receives the wheel's own directory (``dist-weights/``
    beside ``dist/``), so that a wheel built from an unpacked sdist still leaves it where the user looks;
    relative to the project where the front end does not say where the wheel goes."""
    return (output.resolve().parent if output is not None else root) / settings.weights_dir


def publish(settings: Settings, root: Path, output: Path | None, package: Path, report: Any) -> None:
    """Move each external model's weights out of the staged package into ``weights-dir``; say what to upload."""
    external = [m for m in settings.models if m.weights == "external"]
    if external:
        data = manifest.read(package)
        target = weights_dir(settings, root, output)
        for spec in external:
            model = data["models"][spec.name]
            for entry in variants_of(model):  # each variant has a weights file of its own
                _publish_one(settings, spec, entry, package, target, report)
        manifest.write(package, data)
    total = sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
    if total > INDEX_LIMIT:
        report.warning(
            f"aoti: warning: the wheel's models take {total / 10**6:.0f} MB, above the {INDEX_LIMIT // 10**6} MB a "
            'package index such as PyPI takes per file; `weights = "external"` keeps the weights out of the wheel'
        )


def _publish_one(settings: Settings, spec: ModelSpec, entry: Any, package: Path, target: Path, report: Any) -> None:
    """One variant's weights file moved to ``target``, and its entry told where it is served."""
    folder = folder_of(spec.name, entry)
    weights = entry.get("weights")
    if weights is None:  # nothing to fetch: a model without parameters
        report.warning(f'aoti: {folder}: `weights = "external"`, but the model has no weights to keep out')
        return
    source = package / ARTIFACT_DIR / folder / weights["file"]
    name, size = f"{weights['sha256']}.bin", source.stat().st_size
    try:
        _place(source, target / name)
    except OSError as exc:
        raise NotWritten(
            f"model {spec.name!r}: cannot write its weights to {target} ({exc.strerror or exc}); "
            f"set `weights-dir` in {settings.table} to a writable directory with {size / 2**20:.0f} MiB free"
        ) from None
    entry.get("files", {}).pop(weights["file"], None)
    entry.get("sizes", {}).pop(weights["file"], None)  # the wheel's files only (the manifest's check)
    weights["external"] = {"url": str(spec.weights_url), "file": name, "size": size}
    url = str(spec.weights_url).replace("{file}", name)
    mib = size / 2**20
    report.info(f"aoti: {folder}: weights are external: upload {target / name} ({mib:.1f} MiB) to {url}")


def _place(source: Path, dest: Path) -> None:
    """``source`` at ``dest``, whole or not at all; a file already there under its digest's name stays."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and dest.stat().st_size == source.stat().st_size:
        source.unlink()
        return
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        shutil.move(str(source), part)
        part.chmod(0o644)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
