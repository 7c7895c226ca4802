"""Whether this machine can run a target's models, told without importing the package (nor torch,
but for CUDA models): the wheel's torch requirement here, the rest by the loader's own checks, asked
of hatch-aoti's copy of the loader with the target's manifest, so that none of the target's code runs."""

from __future__ import annotations

from typing import Any

from hatch_aoti.cli.target import Target
from hatch_aoti.loader.schema import PRECISION_VARIABLE, Entry, precision_of


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


def problems(target: Target, name: str, precision: str | None = None) -> list[str]:
    """Everything that stops the model (its ``precision`` variant, else the one that loads here) from
    running here, before it is loaded: this environment's torch against the wheel's requirement, then
    what the loader itself checks (the CPU, the device, a precompiled model's Python and torch), which
    imports only torch, and that for CUDA models alone."""
    from hatch_aoti.loader import host

    torch_issue = torch_problem(target)
    found = [torch_issue] if torch_issue else []
    try:
        found += host.problems(variant_of(target, name, precision))
    except ImportError as exc:
        if not torch_issue:  # no torch to ask about the GPU: the torch problem says so already
            found.append(f"the loader cannot tell: {type(exc).__name__}: {exc}")
    except Exception as exc:
        found.append(f"the loader cannot be asked: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return found


def variant_of(target: Target, name: str, precision: str | None = None) -> Entry:
    """The model's ``precision`` variant, else the one the loader takes here (its first where none runs)."""
    from hatch_aoti.loader import host
    from hatch_aoti.loader.schema import variants_of

    entry = target.model(name)
    if precision is not None:
        return next((v for v in variants_of(entry) if precision_of(v) == precision), entry)
    chosen, _ = host.choose(name, entry, refuse=False)
    return chosen if chosen is not None else entry


def variants(target: Target, name: str) -> dict[str, Any]:
    """The model's variants, in the order the build was given: whether this CPU runs each natively, and
    which one the loader would load here (``HATCH_AOTI_PRECISION`` aside), as the loader decides it."""
    from hatch_aoti.loader import host
    from hatch_aoti.loader.schema import variants_of

    entry = target.model(name)
    found = variants_of(entry)
    listed = [
        {
            "precision": precision_of(v),
            "uses": v.get("uses", []),
            "cpu_target": v["cpu"]["target"],
            "native_here": host.variant_problem(v) is None,
        }
        for v in found
    ]
    chosen, passed = host.choose(name, entry, refuse=False)  # /proc/cpuinfo's answer: torch is not imported
    loads = precision_of(chosen) if chosen is not None else None
    return {"variants": listed, "loads_here": loads, "passed_over": passed}


def asked(precision: str | None = None) -> str | None:
    """The variant asked for by name, as ``load()`` takes it: ``precision``, else ``HATCH_AOTI_PRECISION``'s."""
    import os

    return precision or os.environ.get(PRECISION_VARIABLE) or None


def loaded(target: Target, name: str) -> str | None:
    """The precision ``load(name)`` takes here: the one asked for by name, else the loader's choice."""
    return asked() or variants(target, name)["loads_here"]


def packed_at_load(target: Target, name: str) -> int | None:
    """How many of the model's weights its loader packs for this CPU as it loads (``HATCH_AOTI_PACK``
    chooses), as the loader says; None where it cannot tell."""
    from hatch_aoti.loader import packing

    try:
        return len(packing.chosen(target.model(name)))
    except Exception:
        return None


def weights_source(target: Target, name: str) -> dict[str, Any] | None:
    """Where an external model's weights come from and whether they are cached here, as its loader says."""
    from hatch_aoti.loader import external

    try:
        return external.state(name, target.model(name))
    except Exception as exc:
        return {"problem": f"the loader cannot tell: {type(exc).__name__}: {str(exc).splitlines()[0]}"}
