"""Shipped files against the digests recorded for them: the manifest's (per model) and RECORD's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hatch_aoti.cli.target import Target
from hatch_aoti.loader.schema import Entry, folder_of, variants_of
from hatch_aoti.pipeline.artifacts import ARTIFACT_DIR, sha256


def recorded_files(entry: Entry) -> dict[str, str]:
    """A model's files and their sha256 (manifests before per-file digests name the library and weights)."""
    if "files" in entry:
        return dict(entry["files"])
    found = {entry["file"]: entry.get("sha256", "")}
    if "weights" in entry:
        found[entry["weights"]["file"]] = entry["weights"].get("sha256", "")
    return found


def shipped(name: str, entry: Entry) -> Iterator[tuple[str, str, str]]:
    """Each file of each of a model's variants: (its path under ``_aoti``, its path in the variant, its sha256)."""
    for variant in variants_of(entry):
        folder = folder_of(name, variant)
        for rel, digest in recorded_files(variant).items():
            yield f"{folder}/{rel}", rel, digest


@dataclass
class Report:
    models: dict[str, list[str]] = field(default_factory=dict)
    """Problems by model."""
    package: list[str] = field(default_factory=list)
    """Problems with files of no one model (the loader, the manifest)."""
    checked: int = 0


def check(target: Target) -> Report:
    report = Report({name: [] for name in target.models})
    artifacts = target.package_dir / ARTIFACT_DIR
    seen = set()
    for name, entry in target.models.items():
        for where, _, digest in shipped(name, entry):
            report.checked += 1
            seen.add((artifacts / where).resolve())
            problem = _compare(actual(artifacts / where), digest, f"{ARTIFACT_DIR}/{where}", "the manifest")
            if problem:
                report.models[name].append(problem)
    for path, digest, rel in _record_in_package(target):
        if path in seen:
            continue
        report.checked += 1
        problem = _compare(actual(path), digest, rel, "RECORD")
        if problem:
            owner = _model_of(path, artifacts, target)
            (report.models[owner] if owner else report.package).append(problem)
    return report


def actual(path: Path) -> str | None:
    """The file's sha256; ``None`` if it cannot be read."""
    try:
        return sha256(path)
    except OSError:
        return None


def _compare(have: str | None, want: str, what: str, source: str) -> str | None:
    if have is None:
        return f"{what} is missing or unreadable"
    if want and have != want:
        return f"{what} differs from {source} (sha256 {have[:12]}..., recorded {want[:12]}...): damaged or modified"
    return None


def _record_in_package(target: Target) -> list[tuple[Path, str, str]]:
    """RECORD's files inside the package directory that have a sha256: (path, digest, path in the package)."""
    root = target.package_dir.resolve()
    return [
        (path, digest, path.relative_to(root).as_posix())
        for path, digest in target.dist.digests().items()
        if path.is_relative_to(root)
    ]


def _model_of(path: Path, artifacts: Path, target: Target) -> str | None:
    try:
        first = path.relative_to(artifacts.resolve()).parts[0]
    except ValueError:
        return None
    first = first.partition("@")[0]  # a variant's folder: name@precision
    return first if first in target.models else None
