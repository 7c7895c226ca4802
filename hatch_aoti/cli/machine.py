"""Whether this machine can run a target's models, told without importing the package
(nor torch, but for CUDA models)."""

from __future__ import annotations

import os
import platform
from typing import Any

from hatch_aoti.cli.target import Target


def installed_torch() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def torch_problem(target: Target) -> str | None:
    """Why this environment's torch cannot run the target's models; ``None`` if it can."""
    from packaging.requirements import InvalidRequirement, Requirement

    have = installed_torch()
    if have is None:
        return "torch is not installed here"
    for text in target.dist.requires:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name == "torch" and not requirement.specifier.contains(have, prereleases=True):
            return f"the wheel requires {text}; this environment has torch {have}"
    return None


def cpu_problem(entry: dict[str, Any]) -> str | None:
    """Why this CPU cannot run the model (architecture, missing instructions); ``None`` if it can."""
    from hatch_aoti.settings.cpu_targets import host_flags

    cpu, machine = entry["cpu"], os.uname().machine
    if cpu["arch"] != machine:
        return f"built for {cpu['arch']} CPUs ({cpu['target']}); this machine is {machine}"
    flags = host_flags()
    missing = [f for f in cpu["features"] if flags and f not in flags]
    return f"needs {cpu['target']} instructions this CPU lacks: {', '.join(missing)}" if missing else None


def backend_problem(entry: dict[str, Any]) -> str | None:
    """Precompiled models load only under the Python and torch they were built with."""
    if entry.get("backend") != "precompile":
        return None
    here = (platform.python_version(), installed_torch())
    if (entry.get("python"), entry.get("torch")) != here:
        return (
            f"precompiled with Python {entry.get('python')} and torch {entry.get('torch')}; "
            f"this is Python {here[0]} with torch {here[1]}"
        )
    return None


def device_problem(entry: dict[str, Any]) -> str | None:
    """A CUDA model where torch sees no GPU (torch is imported for CUDA models only)."""
    if not str(entry.get("device", "cpu")).startswith("cuda"):
        return None
    import torch

    return None if torch.cuda.is_available() else f"built for {entry['device']}; this torch sees no CUDA device"


def problems(target: Target, entry: dict[str, Any]) -> list[str]:
    """Everything that stops the model from running here, before anything is loaded."""
    found = [p for p in (torch_problem(target), cpu_problem(entry), backend_problem(entry)) if p]
    return found or [p for p in [device_problem(entry)] if p]  # no torch to ask if torch is the problem
