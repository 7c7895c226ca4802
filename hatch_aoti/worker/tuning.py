"""``tune = true``: candidate settings for one model, each compiled, verified and timed; the fastest is kept.

A candidate is the model's own settings with a few of Inductor's changed; the model's
``inductor-configs`` still win over any candidate, so a candidate that changes nothing the user
did not fix is dropped as a duplicate. Times are taken on the build machine, on the model's
example inputs; a time cached by another machine is taken again here (the candidate is not
compiled again), and a candidate that failed is remembered in the local cache.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

#: hatch-aoti's candidates, by name: the settings each changes over the model's.
CANDIDATES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cpp-gemm": {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
    "concat-linear": {"cpp.enable_concat_linear": True},
    "no-freezing": {"freezing": False},
}
#: Rounds of timing, interleaved over the candidates; each candidate's time is its median round.
ROUNDS = 3
#: Separates a model's name from a candidate's in the staged artifacts (never part of an identifier).
SEPARATOR = "--"


def candidates(settings: dict[str, Any], user_configs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each distinct candidate's full settings, by name, ``defaults`` (the model's own settings) first."""
    found: dict[str, dict[str, Any]] = {}
    for name, change in CANDIDATES.items():
        configs = {**settings, **change, **user_configs}
        if configs not in found.values():
            found[name] = configs
    return found


@dataclass
class Tuning:
    """The candidates of one model as they come in: a result (entry, errors, time) or why it was dropped."""

    model: str
    names: list[str]
    start: float = 0.0
    results: dict[str, tuple[dict[str, Any], Any, float]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    cached: dict[str, str] = field(default_factory=dict)
    """Candidates that came from the cache (timed, timed again, or dropped), and from which tier."""
    untimed: dict[str, tuple[dict[str, Any], Any, Any]] = field(default_factory=dict)
    """Candidates verified in this build, waiting to be timed: entry, errors and the miss that stores them."""

    @property
    def complete(self) -> bool:
        return not self.untimed and len(self.results) + len(self.dropped) == len(self.names)

    def best(self) -> str | None:
        """The fastest verified candidate; ties go to the earlier one (``defaults`` first)."""
        timed = [(self.results[n][2], i, n) for i, n in enumerate(self.names) if n in self.results]
        return min(timed)[2] if timed else None

    def record(self) -> dict[str, Any]:
        """``info()["tuning"]``: each candidate's time or why it was dropped, and the one kept."""
        rows = []
        for name in self.names:
            if name in self.results:
                rows.append({"candidate": name, "ms": round(self.results[name][2] * 1e3, 6)})
            else:
                rows.append({"candidate": name, "dropped": self.dropped.get(name, "")})
        return {"chosen": self.best(), "candidates": rows, "timed_on": "the build machine, the example inputs"}


def machine() -> str:
    """What a cached time was measured on: the CPU's model, the CPUs this process may use, torch's
    threads, and which weights the loader packs (``HATCH_AOTI_PACK``, where set). A time from another
    machine is not compared with this one's."""
    import os

    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    pack = os.environ.get("HATCH_AOTI_PACK", "").strip()
    where = f"{_cpu_model()}; {cpus} CPUs; {torch.get_num_threads()} threads"
    return f"{where}; HATCH_AOTI_PACK={pack}" if pack else where


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (read once: every cached candidate asks)."""
    import platform

    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), name)
    return name


def seconds_per_call(model: Any, sample: tuple[tuple[Any, ...], dict[str, Any]]) -> float:
    """Median seconds per call of ``model`` on ``sample``, as ``torch.utils.benchmark`` measures it."""
    import torch
    from torch.utils.benchmark import Timer

    args, kwargs = sample
    with torch.inference_mode():
        model(*args, **kwargs)  # first-call work (page faults of mapped weights) is not the model's speed
        timer = Timer(
            "model(*args, **kwargs)",
            globals={"model": model, "args": args, "kwargs": kwargs},
            num_threads=torch.get_num_threads(),  # the build's threads, not Timer's default of one
        )
        return float(timer.blocked_autorange(min_run_time=0.5).median)
