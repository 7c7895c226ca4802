"""The process split: which of the build's processes compiles each model that missed the cache.

The coordinator keeps one share and hands each other share to a compile helper (``helpers.py``).
"""

from __future__ import annotations

from typing import Any

from hatch_aoti.backends.aoti import packs_weights
from hatch_aoti.worker.checks import Prepared


class Miss:
    """A model (or one of its tuning candidates) that was exported and keyed but is not in the cache."""

    def __init__(
        self, model: Prepared, exported: Any, key: str, entry: dict[str, Any], backend: Any, label: str
    ) -> None:
        self.model, self.exported, self.key, self.entry, self.backend = model, exported, key, entry, backend
        self.label = label
        """Its staged name: the model's, or ``<model>--<candidate>`` for a tuning candidate."""

    @property
    def name(self) -> str:
        return self.model.spec.name

    @property
    def candidate(self) -> str | None:
        from hatch_aoti.worker.tuning import SEPARATOR

        return self.label.partition(SEPARATOR)[2] or None


def processes(misses: list[Miss], jobs: int) -> list[list[str]]:
    """The labels each process compiles, the coordinator's first, at most ``jobs`` processes in all.

    Models whose backend needs the eager module stay in the coordinator. Models that prepack
    weights and models that freeze without it never share a process (see ``packs_weights``), so
    a build with both kinds splits ``jobs`` between them, and takes two processes even at one job.
    """
    helped = [m for m in misses if m.backend.in_helpers]
    packing = [m.label for m in helped if packs_weights(m.entry["inductor_configs"])]
    plain = [m.label for m in helped if m.entry["inductor_configs"].get("freezing") and m.label not in packing]
    if packing and plain:  # models that do not freeze go with either kind: here, the plain one
        rest = [m.label for m in helped if m.label not in packing]
        for_packing = min(max(1, round(jobs * len(packing) / len(helped))), max(1, jobs - 1))
        groups = shares(rest, max(1, jobs - for_packing)) + shares(packing, for_packing)
    else:
        groups = shares([m.label for m in helped], jobs)
    groups[0] += [m.label for m in misses if not m.backend.in_helpers]
    return groups


def mixes_packing(misses: list[Miss]) -> bool:
    """Whether these would freeze both with and without weight prepacking."""
    configs = [m.entry["inductor_configs"] for m in misses]
    return len({packs_weights(c) for c in configs if c.get("freezing")}) > 1


def shares(names: list[str], jobs: int) -> list[list[str]]:
    """Split the misses into at most ``jobs`` shares, round-robin; the first is the coordinator's."""
    count = max(1, min(jobs, len(names)))
    return [names[i::count] for i in range(count)]
