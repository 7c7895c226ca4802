"""Compiled and eager models of a target, or the reason one cannot be had here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hatch_aoti.cli import machine
from hatch_aoti.cli.calls import first_line
from hatch_aoti.cli.target import Target


class Unavailable(Exception):
    """The model cannot be run here; ``skipped`` when only a flag is missing."""

    def __init__(self, reason: str, skipped: bool = False) -> None:
        super().__init__(reason)
        self.skipped = skipped


def compiled(target: Target, name: str, package_code: bool, precision: str | None = None) -> Callable[..., Any]:
    """``compiled.load(name)`` (of ``precision``'s variant), after the checks that need nothing loaded."""
    wanted = machine.asked(precision)
    entry = machine.variant_of(target, name, wanted)
    problems = machine.problems(target, name, wanted)
    if problems:
        raise Unavailable("cannot run here: " + "; ".join(problems))
    if entry.get("backend") == "precompile":
        if not package_code:
            raise Unavailable(
                "precompiled models run the package's own code (their factory) when loaded; "
                "pass --import-package (or --eager) to allow it",
                skipped=True,
            )
        target.allow_package_code()
    try:
        loader = target.loader()
        return loader.load(name, precision=precision) if precision else loader.load(name)
    except Exception as exc:
        raise Unavailable(f"does not load: {type(exc).__name__}: {first_line(exc)}") from None


def eager(target: Target, name: str) -> Any:
    """The eager module, from the factory the manifest names, imported from the target."""
    import pkgutil

    from hatch_aoti.worker.checks import short_exception

    entry = target.model(name)
    factory = entry.get("factory")
    if not factory:
        raise Unavailable("the manifest does not name the model's factory (built by hatch-aoti before 0.2)")
    target.allow_package_code()
    try:
        return pkgutil.resolve_name(factory)().to(entry["device"]).eval()
    except Exception as exc:
        raise Unavailable(f"cannot build the eager model with {factory}: {first_line(short_exception(exc))}") from None


def other_variants(target: Target, name: str, package_code: bool) -> dict[str, Callable[..., Any]]:
    """The model's variants this CPU runs natively, other than the one that loads by default, by precision."""
    found, first = machine.variants(target, name), machine.loaded(target, name)
    loaded = {}
    for variant in found["variants"]:
        if variant["native_here"] and variant["precision"] != first:
            try:
                loaded[variant["precision"]] = compiled(target, name, package_code, variant["precision"])
            except Unavailable:
                continue  # timed where it loads; `hatch-aoti verify` says why not
    return loaded
