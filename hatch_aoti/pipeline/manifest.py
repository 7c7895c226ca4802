"""The manifest (``_aoti/manifest.json``): what the loader, ``hatch-aoti`` and the cache know of each
model. Its types are the loader's (:mod:`hatch_aoti.loader.schema`); here are its one writer and
its one check, used when it is written and when it is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hatch_aoti.loader.schema import ARTIFACT_DIR, FORMAT, MANIFEST, Manifest

#: What every model entry has, and the type of each (manifest format 2).
ENTRY_KEYS = {"call": list, "cpu": dict, "device": str, "file": str}
CPU_KEYS = {"arch": str, "target": str, "features": list}
TOP_KEYS = {"package": str, "loader": str}


def write(package_dir: Path, manifest: Manifest) -> Path:
    """``_aoti/manifest.json``, checked first. Models stay in declaration order (``names()``);
    everything else is sorted, so an entry reads the same whether compiled now or from the cache."""
    reason = problem(manifest)
    if reason is not None:
        raise ValueError(f"the manifest {reason}")
    models = {name: json.loads(json.dumps(entry, sort_keys=True)) for name, entry in manifest["models"].items()}
    path = package_dir / ARTIFACT_DIR / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**manifest, "models": models}, indent=2) + "\n", encoding="utf-8")
    path.chmod(0o644)
    return path


def read(package_dir: Path) -> Manifest:
    """The manifest of a package directory; a :class:`ValueError` says what makes it unusable."""
    try:
        data = json.loads((package_dir / ARTIFACT_DIR / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable {ARTIFACT_DIR}/{MANIFEST} ({exc})") from None
    reason = problem(data)
    if reason is not None:
        raise ValueError(f"{ARTIFACT_DIR}/{MANIFEST} {reason}")
    manifest: Manifest = data
    return manifest


def problem(manifest: Any) -> str | None:
    """What makes a manifest unusable, or ``None``: its readers can then index it freely."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("models"), dict):
        return "has no `models` table"
    if manifest.get("format") != FORMAT:
        return f"is of format {manifest.get('format')!r}; this hatch-aoti reads format {FORMAT}"
    for name, entry in manifest["models"].items():
        reason = entry_problem(entry)
        if reason is not None:
            return f"model {name!r}: {reason}"
    for key, kind in TOP_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            return f"`{key}` is missing or not a {kind.__name__}"
    return None


def entry_problem(entry: Any) -> str | None:
    """What makes one model's entry unusable, or ``None`` (the remote cache checks the entries it is sent)."""
    if not isinstance(entry, dict):
        return "not a table"
    for table, keys, label in ((entry, ENTRY_KEYS, ""), (entry.get("cpu"), CPU_KEYS, "cpu.")):
        for key, kind in keys.items():
            if not isinstance(table, dict) or not isinstance(table.get(key), kind):
                return f"`{label}{key}` is missing or not a {kind.__name__}"
    if not isinstance(entry.get("files", {}), dict):
        return "`files` is not a table"
    if not all(
        isinstance(leaf, dict) and ("const" in leaf or isinstance(leaf.get("shape"), list)) for leaf in entry["call"]
    ):
        return "`call` has an input without a shape"
    return None
