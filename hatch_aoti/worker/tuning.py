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
import hashlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hatch_aoti.pipeline import protocol
from hatch_aoti.store.cache import NoSpace

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
REMEMBERED = "(remembered from an earlier build)"


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


class Build(Protocol):
    """What the tuner uses of the build that holds it (the coordinator)."""

    cache: Any
    stage: Path
    artifacts: Path
    entries: dict[str, dict[str, Any]]
    """The models kept, by name: a tuned model's entry goes there once its fastest candidate is known."""
    failed: dict[str, str]

    def emit(self, event: protocol.Event) -> None: ...

    def fail(self, name: str, stage: str, message: str) -> None: ...

    def store(self, miss: Any, record: dict[str, Any]) -> bool: ...

    def staged_loader(self, models: dict[str, dict[str, Any]]) -> Any: ...


class Tuner:
    """The tuned models of one build, from their candidates' look-up to the one kept for each.

    A candidate comes in from the cache (timed on this machine, to be timed again here, or
    dropped), or compiled and verified in this build; the ones not timed yet are timed once every
    compile is done. A model is done once all its candidates are in: the fastest is kept as the
    model, the others removed; a model none of whose candidates passed fails."""

    def __init__(self, build: Build) -> None:
        self.build = build
        self.tunings: dict[str, Tuning] = {}

    def begin(self, name: str, candidates: list[str], start: float) -> None:
        """``name`` is tuned over ``candidates``: its time counts from ``start``."""
        self.tunings[name] = Tuning(name, candidates, start=start)

    def time_candidates(self, prepared: list[Any]) -> None:
        """Time every verified candidate not timed yet, once no compile runs beside the timings: in
        interleaved rounds, through the loader that ships, on the model's example inputs."""
        build = self.build
        for name, tuning in self.tunings.items():
            if not tuning.untimed or name in build.failed:
                continue
            model = next(m for m in prepared if m.spec.name == name)
            build.emit(protocol.Stage(name, "tune"))
            times: dict[str, list[float]] = {c: [] for c in tuning.untimed}
            loaded = {c: build.staged_loader({f"{name}{SEPARATOR}{c}": e}) for c, (e, _, _) in tuning.untimed.items()}
            for _ in range(ROUNDS):
                for candidate in list(times):
                    try:
                        call = loaded[candidate].load(f"{name}{SEPARATOR}{candidate}")
                        times[candidate].append(seconds_per_call(call, model.plan.export_sample))
                    except Exception as exc:
                        entry, _, miss = tuning.untimed.pop(candidate)
                        del times[candidate]
                        self.drop(miss, "tune", f"timing it failed: {type(exc).__name__}: {exc}")
            for candidate, values in times.items():
                entry, errors, miss = tuning.untimed.pop(candidate)
                seconds = sorted(values)[len(values) // 2]
                timing = {"seconds": seconds, "machine": machine()}
                if candidate in tuning.cached:  # cached with another machine's time: this one's, kept here
                    self.write_note(miss, {"seconds": seconds}, per_machine=True)
                elif not build.store(miss, {"entry": {**entry, "tuning": timing}, "errors": errors}):
                    return
                self.tuned(miss.label, entry, errors, seconds, cached=tuning.cached.get(candidate, ""), now=True)

    def cached_candidate(self, miss: Any, record: dict[str, Any], tier: str) -> bool:
        """A candidate from the cache: dropped, timed on this machine, or to be timed again here, without
        compiling it; ``False`` for a drop that another machine remembered (it is compiled here)."""
        timing, candidate = record["entry"].get("tuning", {}), str(miss.candidate)
        if "dropped" in timing and timing.get("machine") != machine():
            return False
        self.tunings[miss.name].cached[candidate] = tier
        if "dropped" in timing:
            self.drop(miss, "cache", f"{timing['dropped']} {REMEMBERED}")
            return True
        if timing.get("machine") != machine():  # its time says nothing of this one's: this machine's, if taken
            timing = self.machine_time(miss)
        if timing.get("seconds") is not None and timing.get("machine") == machine():
            self.tuned(miss.label, miss.entry, record.get("errors"), timing["seconds"], cached=tier)
        else:
            self.tunings[miss.name].untimed[candidate] = (miss.entry, record.get("errors"), miss)
        return True

    def verified(self, miss: Any, entry: dict[str, Any], errors: Any) -> None:
        """A candidate compiled and verified in this build: timed once every compile is done."""
        self.tunings[miss.name].untimed[str(miss.candidate)] = (entry, errors, miss)

    def drop(self, miss: Any, stage: str, message: str, *, lasting: bool = False) -> None:
        """A candidate is dropped, with one line, and its staged files removed.

        A candidate that would fail again (its compile or its verification) is remembered in
        the local cache, so a rebuild does not compile it again; another machine may, so the
        remote tier is not told."""
        shutil.rmtree(self.build.artifacts / miss.label, ignore_errors=True)
        first = message.strip().splitlines()[0] if message.strip() else stage
        why = first if stage == "cache" else f"{stage}: {first}"
        if lasting:
            self.write_note(miss, {"dropped": why}, per_machine=False)
        self.build.emit(protocol.Info(f"{miss.name}: candidate {miss.candidate} dropped at {why}"))
        self.tunings[miss.name].dropped[miss.candidate] = why.removesuffix(f" {REMEMBERED}")
        self.finish(miss.name)

    def note_key(self, miss: Any, *, per_machine: bool) -> str:
        """Where a candidate's note goes: its own key (a drop), or one of this machine's (a time)."""
        return hashlib.sha256(f"{miss.key} {machine()}".encode()).hexdigest() if per_machine else miss.key

    def write_note(self, miss: Any, note: dict[str, Any], *, per_machine: bool) -> None:
        """Keep a candidate's note, with the machine, in the local cache only (another machine would not
        share it): why it was dropped, or this machine's time. Remembering is a saving, never a failure."""
        local = getattr(self.build.cache, "local", None)
        if not miss.key or local is None:
            return
        scratch = self.build.stage / "notes" / miss.label
        with contextlib.suppress(OSError, NoSpace):
            scratch.mkdir(parents=True, exist_ok=True)
            record = {"entry": {"tuning": {**note, "machine": machine()}}, "errors": None}
            local.store(self.note_key(miss, per_machine=per_machine), scratch, record)
        shutil.rmtree(scratch, ignore_errors=True)

    def machine_time(self, miss: Any) -> dict[str, Any]:
        """This machine's time for a candidate that another machine timed, if it took one before."""
        local = getattr(self.build.cache, "local", None)
        if not miss.key or local is None:
            return {}
        scratch = self.build.stage / "notes" / miss.label
        found = None
        with contextlib.suppress(OSError, NoSpace, ValueError):
            found = (local.lookup(self.note_key(miss, per_machine=True), scratch) or {}).get("entry", {}).get("tuning")
        shutil.rmtree(scratch, ignore_errors=True)
        return found if isinstance(found, dict) else {}

    def tuned(
        self, label: str, entry: dict[str, Any], errors: Any, seconds: float, *, cached: str, now: bool = False
    ) -> None:
        """One candidate verified and timed (now, or when it was cached: ``cached`` names the tier); the
        model is done once all of them are."""
        name, _, candidate = label.partition(SEPARATOR)
        tuning = self.tunings[name]
        tuning.results[candidate] = (entry, errors, seconds)
        if cached:
            tuning.cached[candidate] = cached
        how = ("from cache, timed again here" if now else "from cache") if cached else "verified"
        self.build.emit(protocol.Info(f"{name}: candidate {candidate}: {seconds * 1e3:.2f} ms per call, {how}"))
        self.finish(name)

    def finish(self, name: str) -> None:
        """Once every candidate of ``name`` is in: keep the fastest as the model, remove the others."""
        from hatch_aoti.worker.verify import summary

        build, tuning = self.build, self.tunings.get(name)
        if tuning is None or not tuning.complete or name in build.entries or name in build.failed:
            return
        best = tuning.best()
        for candidate in tuning.names:
            if candidate != best:
                shutil.rmtree(build.artifacts / f"{name}{SEPARATOR}{candidate}", ignore_errors=True)
        if best is None:
            reasons = "; ".join(f"{c}: {why}" for c, why in tuning.dropped.items())
            again = [c for c in tuning.dropped if c in tuning.cached]
            hint = f"; {', '.join(again)} {REMEMBERED}: `hatch-aoti cache clear` tries them again" if again else ""
            build.fail(name, "tune", f"no candidate compiled and verified ({reasons}){hint}")
            return
        shutil.rmtree(build.artifacts / name, ignore_errors=True)
        (build.artifacts / f"{name}{SEPARATOR}{best}").rename(build.artifacts / name)
        entry, errors, _ = tuning.results[best]
        build.entries[name] = {**entry, "tuning": tuning.record()}
        build.emit(protocol.Info(f"{name}: tuned: kept {best} (times taken on this machine)"))
        check = summary(entry["verification"], errors)
        elapsed = time.perf_counter() - tuning.start
        if set(tuning.cached) == set(tuning.results) | set(tuning.dropped):
            tier = "remote" if "remote" in tuning.cached.values() else "local"
            build.emit(protocol.Cached(name, elapsed, check, tier))
        else:
            build.emit(protocol.Built(name, elapsed, check))


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
