"""The coordinator: the one process of a build that imports torch and the project's models.

Run as ``python -m hatch_aoti.worker.coordinator JOB`` by the build backend (``pipeline/core.py``):
1. check every model before anything is exported; any problem ends the build, all of them listed;
2. export each model and key it from the exported program; cache hits go straight to the staged package;
3. compile the misses: one share here, the others in compile helpers started for them (``helpers.py``);
4. verify each compiled model against eager through the staged loader, and cache it once it passes;
5. a model that fails never stops the others; the last event says which built and which failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hatch_aoti.backends.aoti import packs_weights
from hatch_aoti.backends.interface import ProgramFacts
from hatch_aoti.pipeline import protocol
from hatch_aoti.pipeline.children import Parent
from hatch_aoti.pipeline.protocol import HelperJob, Job, Task
from hatch_aoti.settings.spec import ModelSpec
from hatch_aoti.store.cache import NoSpace, out_of_space
from hatch_aoti.worker.bootstrap import setup
from hatch_aoti.worker.checks import Prepared, check_model
from hatch_aoti.worker.facts import program_facts, resolved_weights, weights_size
from hatch_aoti.worker.helpers import Helpers, Outcome, lasting, shares


class ModelFailure(Exception):
    def __init__(self, stage: str, message: str, *, lasting: bool = False) -> None:
        self.stage, self.lasting = stage, lasting  # lasting: the same inputs would fail the same way
        super().__init__(message)


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


class Coordinator:
    def __init__(self, job: Job, parent: Parent) -> None:
        from hatch_aoti.pipeline.artifacts import ARTIFACT_DIR
        from hatch_aoti.store.cache import CompileCache
        from hatch_aoti.store.remote import RemoteCache
        from hatch_aoti.store.tiers import Tiers

        self.job, self.emit = job, parent.emit
        self.stage = Path(job.stage)
        self.package = self.stage / "package"
        self.artifacts = self.package / ARTIFACT_DIR
        local = None
        if job.cache is not None and job.cache_max_size is not None:
            local = CompileCache(Path(job.cache), job.cache_max_size)
        remote = RemoteCache(job.remote) if job.remote is not None else None
        self.cache = Tiers(local, remote, lambda message: self.emit(protocol.Notice(message)), self.stage / "downloads")
        self.entries: dict[str, dict[str, Any]] = {}
        self.failed: dict[str, str] = {}
        self.factories: dict[str, str] = {}
        self.signatures: dict[str, list[dict[str, Any]]] = {}
        self.tunings: dict[str, Any] = {}
        self.facts: dict[str, ProgramFacts] = {}
        """What each model's exported program says of it, by model."""

    def run(self, specs: list[ModelSpec]) -> None:
        self.factories = {spec.name: spec.factory for spec in specs}
        problems: list[tuple[str, str]] = []
        prepared = []
        for spec in specs:
            self.emit(protocol.Stage(spec.name, "check"))
            model = check_model(spec, problems)
            if model is not None:
                prepared.append(model)
        if problems:
            self.emit(protocol.Problems(problems))
            return
        self.prepared = prepared
        misses = [m for model in prepared for m in self.export_and_look_up(model)]
        self.compile(misses)
        self.time_candidates()
        if not self.failed:
            self.write_manifest({s.name: self.entries[s.name] for s in specs})
        self.emit(protocol.Done(_torch_version(), list(self.entries), list(self.failed)))

    # -- export, key, cache ---------------------------------------------------------------

    def export_and_look_up(self, model: Prepared) -> list[Miss]:
        """Export the model and look it up (each candidate, if it is tuned); what is left to compile."""
        from hatch_aoti import backends
        from hatch_aoti.settings.cpu_targets import resolve
        from hatch_aoti.worker import tuning

        spec, start = model.spec, time.perf_counter()
        self.emit(protocol.Stage(spec.name, "export"))
        try:
            exported = self.export(model)
        except ModelFailure as exc:
            self.fail(spec.name, exc.stage, str(exc))
            return []
        self.name_foreign_containers(spec.name, exported)
        backend = backends.get(model.spec.backend)
        cpu = resolve(model.spec.cpu_target)
        facts = self.facts[spec.name] = program_facts(exported)
        spec = model.spec = resolved_weights(model.spec, facts)
        settings = backend.settings(model.user_configs, cpu, spec, facts)
        if not spec.tune:
            miss = self.look_up(model, exported, backend, cpu, spec.name, settings, start)
            return [miss] if miss else []
        found = tuning.candidates(settings, model.user_configs)
        self.tunings[spec.name] = tuning.Tuning(spec.name, list(found), start=start)
        self.emit(protocol.Info(f"{spec.name}: tuning {len(found)} candidates: {', '.join(found)}"))
        misses = []
        for name, configs in found.items():
            label = f"{spec.name}{tuning.SEPARATOR}{name}"
            miss = self.look_up(model, exported, backend, cpu, label, configs, start)
            misses += [miss] if miss else []
        self.finish_tuning(spec.name)  # every candidate was cached, or failed already
        return misses

    def name_foreign_containers(self, name: str, exported: Any) -> None:
        """Say which other packages the installed loader imports to rebuild the model's containers."""
        found = [m for m in container_modules(exported, named_only=True) if m.partition(".")[0] != "torch"]
        foreign = [m for m in found if m.partition(".")[0] != self.job.package.partition(".")[0]]
        if foreign:  # the project's own package is no dependency
            self.emit(protocol.Info(f"{name}: {FOREIGN_CONTAINERS.format(', '.join(foreign))}"))

    def look_up(
        self, model: Prepared, exported: Any, backend: Any, cpu: Any, label: str, configs: dict[str, Any], start: float
    ) -> Miss | None:
        """The model (or candidate ``label``) from the cache, staged; else what compiling it needs."""
        from hatch_aoti.worker.fingerprint import cache_key
        from hatch_aoti.worker.inputs import call_spec, describe_call, describe_outputs

        spec = model.spec
        self.factories[label] = spec.factory
        self.signatures[spec.name] = self.signatures[label] = model.signature  # a tuned model's candidates too
        key = ""
        if self.cache.enabled:
            # Files compiled with the eager module and the loader may name them (precompiled code does).
            names = {} if backend.in_helpers else {"loader": self.loader_name, "factory": spec.factory}
            tuned = {"tune": label} if label != spec.name else {}  # a candidate's entry holds its time too
            key = cache_key(exported, spec, model.plan, configs, {**backend.key(), **names, **tuned})
        try:
            found = self.cache.lookup(spec.name, key, spec.backend, self.artifacts / label) if key else None
        except NoSpace as exc:
            self.fail(spec.name, "cache", str(exc))
            return None
        if found is not None:
            record, tier = found
            entry = {k: v for k, v in record["entry"].items() if k != "tuning"}
            if label == spec.name:
                self.entries[spec.name] = entry
                check = _summary(entry["verification"], record.get("errors"))
                self.emit(protocol.Cached(spec.name, time.perf_counter() - start, check, tier))
                return None
            if self.cached_candidate(Miss(model, exported, key, entry, backend, label), record, tier):
                return None
            shutil.rmtree(self.artifacts / label, ignore_errors=True)  # dropped on another machine: compiled here
        try:
            call, outputs = describe_call(exported, model.plan, model.mutated), describe_outputs(exported)
        except ValueError as exc:  # a size the loader cannot check (not a*dim + b)
            self.fail(spec.name, "export", str(exc))
            return None
        entry = {
            "backend": spec.backend,
            "call": call,
            "outputs": outputs,
            "call_spec": call_spec(exported),
            "device": spec.device,
            "inputs": model.plan.description,
            "dynamic": dynamic_info(model.plan),
            "inductor_configs": configs,
            "cpu": {"target": cpu.name, "arch": cpu.arch, "features": list(cpu.features)},
        }
        return Miss(model, exported, key, entry, backend, label)

    def export(self, model: Prepared) -> Any:
        """``torch.export``; where it finds that dims are related (a length that must be a multiple of a
        frame), the relations it suggests are applied and the model exported again."""
        import torch

        for attempt in range(3):
            args, kwargs = model.plan.export_sample
            try:
                return torch.export.export(model.module, args, kwargs, dynamic_shapes=model.plan.dynamic_shapes)
            except Exception as exc:
                failure = ModelFailure("export", f"torch.export failed: {type(exc).__name__}: {exc}")
                if attempt == 2 or not self.apply_suggested_rules(model, str(exc)):
                    raise failure from None
        raise AssertionError("unreachable")

    def apply_suggested_rules(self, model: Prepared, message: str) -> bool:
        """The model's plan again with the rules torch suggests; False where there are none to apply, or
        its backend cannot take them, or they do not fit its samples."""
        from hatch_aoti import backends
        from hatch_aoti.worker.inputs import suggested_rules

        rules = suggested_rules(message, set(model.plan.dims), model.plan.rules)
        if rules is None or model.replan is None:
            return False
        spec = dataclasses.replace(model.spec, dynamic={**model.spec.dynamic, **rules})
        if backends.get(spec.backend).check(spec):
            return False  # the precompile backend takes bounds only: torch's own message stands
        try:
            model.plan, model.spec = model.replan(spec), spec
        except Exception:
            return False
        self.emit(
            protocol.Info(
                f"{spec.name}: dims are related, as torch.export found: {describe_rules(rules)}; "
                f"exported again with them (write them in `{spec.path}.dynamic` to skip the retry)"
            )
        )
        return True

    # -- compile, verify, store -----------------------------------------------------------

    def compile(self, misses: list[Miss]) -> None:
        """One share here, the others in compile helpers (see ``processes``)."""
        by_name = {m.label: m for m in misses}
        here, *away = processes(misses, self.job.jobs)
        tasks: list[list[Task]] = []
        for group in away:
            saved = [t for t in (self.task_for(by_name[name]) for name in group) if t is not None]
            for name in [name for name in group if name not in {t.model for t in saved}]:
                if mixes_packing([by_name[n] for n in here] + [by_name[name]]):
                    self.fail_or_drop(by_name[name], "compile", CANNOT_SHARE)
                else:
                    here.append(name)
            if saved:
                tasks.append(saved)
        if tasks:
            self.emit(protocol.Info(f"{len(misses)} models to compile: {len(tasks) + 1} processes in parallel"))
        helpers = Helpers(self.stage, HelperJob([], "", self.job.sys_path, self.job.cwd, self.job.cache))
        try:
            helpers.start(tasks)
            for name in here:
                self.finish(by_name[name], self.compile_here(by_name[name]))
            for outcome in helpers.outcomes():
                self.finish(by_name[outcome.model], outcome)
        finally:
            helpers.end()

    def task_for(self, miss: Miss) -> Task | None:
        """The miss as a helper's task: its program saved to disk; ``None`` if it cannot be saved."""
        import torch

        program = self.stage / "programs" / f"{miss.label}.pt2"
        program.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.export.save(miss.exported, program)
        except Exception:
            return None
        modules = [miss.model.spec.factory.partition(":")[0], *container_modules(miss.exported)]
        return Task(
            miss.label,
            miss.model.spec.backend,
            str(program),
            str(self.artifacts / miss.label),
            miss.entry["inductor_configs"],
            modules,
        )

    def compile_here(self, miss: Miss) -> Outcome:
        from hatch_aoti.backends import Request

        self.emit(protocol.Stage(miss.name, "compile"))
        start = time.perf_counter()
        work = self.stage / "work"
        work.mkdir(exist_ok=True)
        if not miss.backend.in_helpers:
            self.import_loader_as_installed()
        request = Request(
            miss.name,
            miss.exported,
            miss.entry["inductor_configs"],
            self.artifacts / miss.label,
            work,
            module=miss.model.module,
            plan=miss.model.plan,
            loader=self.loader_name,
            factory=miss.model.spec.factory,
            spec=miss.model.spec,
            facts=self.facts.get(miss.name),
        )
        try:
            files = miss.backend.compile(request)
        except Exception as exc:
            if out_of_space(exc):  # the library, and the weights twice (Inductor's package, then unpacked)
                return Outcome(miss.name, error=str(NoSpace(self.stage, 2 * weights_size(miss.exported))))
            failed = f"the {miss.backend.name} backend failed: {type(exc).__name__}: {exc}"
            return Outcome(miss.name, error=failed, lasting=lasting(exc))
        return Outcome(miss.name, files=files, seconds=time.perf_counter() - start)

    @property
    def loader_name(self) -> str:
        """What the generated loader is called where the wheel is installed."""
        return f"{self.job.package}.{self.job.loader}"

    def import_loader_as_installed(self) -> None:
        """The staged loader, imported under its installed name: artifacts that refer to its code
        (precompiled functions) then name a module that exists wherever the wheel goes."""
        if self.loader_name in sys.modules:
            return
        from hatch_aoti.pipeline.artifacts import import_package

        self.write_manifest(self.entries)
        import_package(self.loader_name, self.package / self.job.loader)

    def finish(self, miss: Miss, outcome: Outcome) -> None:
        """Verify a compiled model, and keep it (staged and cached) once it passes; time a candidate."""
        if outcome.error is not None:
            self.fail_or_drop(miss, "compile", outcome.error, lasting=outcome.lasting)
            return
        entry = {**(outcome.files or {}), **miss.entry}
        entry["files"] = shipped_files(self.artifacts / miss.label, entry)
        entry["sizes"] = {rel: (self.artifacts / miss.label / rel).stat().st_size for rel in entry["files"]}
        self.emit(protocol.Stage(miss.name, "verify"))
        start = time.perf_counter()
        try:
            entry["verification"], errors = self.verify(miss, entry)
        except ModelFailure as exc:
            self.fail_or_drop(miss, "verify", str(exc), lasting=exc.lasting)
            return
        if miss.candidate:  # timed once every compile is done, stored with its time
            self.tunings[miss.name].untimed[miss.candidate] = (entry, errors, miss)
            return
        if not self.store(miss, {"entry": entry, "errors": errors}):
            return
        self.entries[miss.name] = entry
        elapsed = outcome.seconds + time.perf_counter() - start
        self.emit(protocol.Built(miss.name, elapsed, _summary(entry["verification"], errors)))

    def store(self, miss: Miss, record: dict[str, Any]) -> bool:
        """Put a verified model (or candidate) in the cache; False where it failed for want of space."""
        if not self.cache.enabled:
            return True
        self.emit(protocol.Stage(miss.name, "store"))
        try:
            self.cache.store(miss.name, miss.key, self.artifacts / miss.label, record)
        except NoSpace as exc:
            self.fail(miss.name, "cache", str(exc))
            return False
        return True

    def verify(self, miss: Miss, entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float] | None]:
        from hatch_aoti.worker.verify import VerificationFailed, rebuilt_unlike, verify_model

        spec = miss.model.spec
        if not spec.verify:
            return {"passed": None, "skipped": "verify = false"}, None
        loader = self.staged_loader({miss.label: entry})
        try:
            compiled = loader.load(miss.label)
            if "weights" in entry and getattr(compiled, "weights", None):  # mapped, not only packed at load
                use_module_weights(miss.model.module, compiled, self.artifacts / miss.label, entry["weights"])
            plan = miss.model.plan
            samples = [*plan.verify_samples, *region_edges(plan, entry.get("regions", []))]
            report, worst = verify_model(miss.model.module, samples, compiled, spec.rtol, spec.atol)
        except VerificationFailed as exc:
            rebuilt = exc.mismatch and "module" in entry.get("needs", {})  # built by the factory at load
            why = rebuilt_unlike(spec, miss.backend.name) if rebuilt else None
            raise ModelFailure("verify", f"{exc}; {why}" if why else str(exc), lasting=exc.mismatch) from None
        except RuntimeError as exc:  # the loader refused this machine
            raise ModelFailure("verify", str(exc)) from None
        except Exception as exc:
            raise ModelFailure("verify", f"{type(exc).__name__}: {exc}") from None
        generated = {label for label, _ in plan.verify_samples} if plan.seed is not None else set()
        for tried in report["tried"]:  # what `hatch-aoti verify` can remake exactly
            if tried["inputs"] in generated:
                tried["seed"] = plan.seed
        return report, worst

    # -- tuning -----------------------------------------------------------------------------

    def time_candidates(self) -> None:
        """Time every verified candidate not timed yet, once no compile runs beside the timings: in
        interleaved rounds, through the loader that ships, on the model's example inputs."""
        from hatch_aoti.worker.tuning import ROUNDS, SEPARATOR, machine, seconds_per_call

        for name, tuning in self.tunings.items():
            if not tuning.untimed or name in self.failed:
                continue
            model = next(m for m in self.prepared if m.spec.name == name)
            self.emit(protocol.Stage(name, "tune"))
            times: dict[str, list[float]] = {c: [] for c in tuning.untimed}
            loaded = {c: self.staged_loader({f"{name}{SEPARATOR}{c}": e}) for c, (e, _, _) in tuning.untimed.items()}
            for _ in range(ROUNDS):
                for candidate in list(times):
                    try:
                        call = loaded[candidate].load(f"{name}{SEPARATOR}{candidate}")
                        times[candidate].append(seconds_per_call(call, model.plan.export_sample))
                    except Exception as exc:
                        entry, _, miss = tuning.untimed.pop(candidate)
                        del times[candidate]
                        self.fail_or_drop(miss, "tune", f"timing it failed: {type(exc).__name__}: {exc}")
            for candidate, values in times.items():
                entry, errors, miss = tuning.untimed.pop(candidate)
                seconds = sorted(values)[len(values) // 2]
                timing = {"seconds": seconds, "machine": machine()}
                if candidate in tuning.cached:  # cached with another machine's time: this one's, kept here
                    self.write_note(miss, {"seconds": seconds}, per_machine=True)
                elif not self.store(miss, {"entry": {**entry, "tuning": timing}, "errors": errors}):
                    return
                self.tuned(miss.label, entry, errors, seconds, cached=tuning.cached.get(candidate, ""), now=True)

    def cached_candidate(self, miss: Miss, record: dict[str, Any], tier: str) -> bool:
        """A candidate from the cache: dropped, timed on this machine, or to be timed again here, without
        compiling it; ``False`` for a drop that another machine remembered (it is compiled here)."""
        from hatch_aoti.worker.tuning import machine

        timing, candidate = record["entry"].get("tuning", {}), str(miss.candidate)
        if "dropped" in timing and timing.get("machine") != machine():
            return False
        self.tunings[miss.name].cached[candidate] = tier
        if "dropped" in timing:
            self.fail_or_drop(miss, "cache", f"{timing['dropped']} {REMEMBERED}")
            return True
        if timing.get("machine") != machine():  # its time says nothing of this one's: this machine's, if taken
            timing = self.machine_time(miss)
        if timing.get("seconds") is not None and timing.get("machine") == machine():
            self.tuned(miss.label, miss.entry, record.get("errors"), timing["seconds"], cached=tier)
        else:
            self.tunings[miss.name].untimed[candidate] = (miss.entry, record.get("errors"), miss)
        return True

    def fail_or_drop(self, miss: Miss, stage: str, message: str, *, lasting: bool = False) -> None:
        """A model fails; a candidate is only dropped, with one line, and its staged files removed.

        A candidate that would fail again (its compile or its verification) is remembered in
        the local cache, so a rebuild does not compile it again; another machine may, so the
        remote tier is not told."""
        if not miss.candidate:
            self.fail(miss.name, stage, message)
            return
        shutil.rmtree(self.artifacts / miss.label, ignore_errors=True)
        first = message.strip().splitlines()[0] if message.strip() else stage
        why = first if stage == "cache" else f"{stage}: {first}"
        if lasting:
            self.write_note(miss, {"dropped": why}, per_machine=False)
        self.emit(protocol.Info(f"{miss.name}: candidate {miss.candidate} dropped at {why}"))
        self.tunings[miss.name].dropped[miss.candidate] = why.removesuffix(f" {REMEMBERED}")
        self.finish_tuning(miss.name)

    def note_key(self, miss: Miss, *, per_machine: bool) -> str:
        """Where a candidate's note goes: its own key (a drop), or one of this machine's (a time)."""
        import hashlib

        from hatch_aoti.worker.tuning import machine

        return hashlib.sha256(f"{miss.key} {machine()}".encode()).hexdigest() if per_machine else miss.key

    def write_note(self, miss: Miss, note: dict[str, Any], *, per_machine: bool) -> None:
        """Keep a candidate's note, with the machine, in the local cache only (another machine would not
        share it): why it was dropped, or this machine's time. Remembering is a saving, never a failure."""
        from hatch_aoti.worker.tuning import machine

        local = getattr(self.cache, "local", None)
        if not miss.key or local is None:
            return
        scratch = self.stage / "notes" / miss.label
        with contextlib.suppress(OSError, NoSpace):
            scratch.mkdir(parents=True, exist_ok=True)
            record = {"entry": {"tuning": {**note, "machine": machine()}}, "errors": None}
            local.store(self.note_key(miss, per_machine=per_machine), scratch, record)
        shutil.rmtree(scratch, ignore_errors=True)

    def machine_time(self, miss: Miss) -> dict[str, Any]:
        """This machine's time for a candidate that another machine timed, if it took one before."""
        local = getattr(self.cache, "local", None)
        if not miss.key or local is None:
            return {}
        scratch = self.stage / "notes" / miss.label
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
        from hatch_aoti.worker.tuning import SEPARATOR

        name, _, candidate = label.partition(SEPARATOR)
        tuning = self.tunings[name]
        tuning.results[candidate] = (entry, errors, seconds)
        if cached:
            tuning.cached[candidate] = cached
        how = ("from cache, timed again here" if now else "from cache") if cached else "verified"
        self.emit(protocol.Info(f"{name}: candidate {candidate}: {seconds * 1e3:.2f} ms per call, {how}"))
        self.finish_tuning(name)

    def finish_tuning(self, name: str) -> None:
        """Once every candidate of ``name`` is in: keep the fastest as the model, remove the others."""
        from hatch_aoti.worker.tuning import SEPARATOR

        tuning = self.tunings.get(name)
        if tuning is None or not tuning.complete or name in self.entries or name in self.failed:
            return
        best = tuning.best()
        for candidate in tuning.names:
            if candidate != best:
                shutil.rmtree(self.artifacts / f"{name}{SEPARATOR}{candidate}", ignore_errors=True)
        if best is None:
            reasons = "; ".join(f"{c}: {why}" for c, why in tuning.dropped.items())
            again = [c for c in tuning.dropped if c in tuning.cached]
            hint = f"; {', '.join(again)} {REMEMBERED}: `hatch-aoti cache clear` tries them again" if again else ""
            self.fail(name, "tune", f"no candidate compiled and verified ({reasons}){hint}")
            return
        shutil.rmtree(self.artifacts / name, ignore_errors=True)
        (self.artifacts / f"{name}{SEPARATOR}{best}").rename(self.artifacts / name)
        entry, errors, _ = tuning.results[best]
        self.entries[name] = {**entry, "tuning": tuning.record()}
        self.emit(protocol.Info(f"{name}: tuned: kept {best} (times taken on this machine)"))
        check = _summary(entry["verification"], errors)
        elapsed = time.perf_counter() - tuning.start
        if set(tuning.cached) == set(tuning.results) | set(tuning.dropped):
            tier = "remote" if "remote" in tuning.cached.values() else "local"
            self.emit(protocol.Cached(name, elapsed, check, tier))
        else:
            self.emit(protocol.Built(name, elapsed, check))

    def fail(self, name: str, stage: str, message: str) -> None:
        self.failed[name] = stage
        self.emit(protocol.Failed(name, stage, message))

    # -- the staged package ---------------------------------------------------------------

    def write_manifest(self, models: dict[str, dict[str, Any]]) -> None:
        """The staged loader and manifest, for ``models``; a model's factory and ``forward`` signature are
        added here, not cached (entries are shared between projects, whose factories have other names)."""
        from hatch_aoti import __version__, backends
        from hatch_aoti.loader.schema import FORMAT, Manifest
        from hatch_aoti.pipeline import manifest
        from hatch_aoti.pipeline.artifacts import write_loader, write_runtime

        entries: dict[str, Any] = {
            name: {**entry, "factory": self.factories[name], "signature": self.signatures.get(name, [])}
            for name, entry in models.items()
        }
        manifest.write(
            self.package,
            Manifest(
                format=FORMAT,
                hatch_aoti=__version__,
                torch=_torch_version(),
                package=self.job.package,
                loader=self.job.loader,
                models=entries,
            ),
        )
        write_loader(self.package, self.job.loader)
        for name in sorted({entry["backend"] for entry in models.values()}):
            runtime = backends.get(name).runtime
            if runtime is not None:
                write_runtime(self.package, name, runtime)

    def staged_loader(self, models: dict[str, dict[str, Any]]) -> Any:
        """A fresh import of the loader that ships, over a manifest holding ``models``: verification uses it."""
        from hatch_aoti.pipeline.artifacts import import_package

        self.write_manifest(models)
        return import_package(f"_hatch_aoti_staged_{len(self.entries)}", self.package / self.job.loader)


def region_edges(plan: Any, regions: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Inputs at both ends of every compiled region of sizes (an unbounded end: 2 * its start + 1)."""
    from hatch_aoti.worker.inputs import resized

    out = []
    for region in regions:
        for label, pick in (("start", 0), ("end", 1))[: 1 if _single(region["dims"]) else 2]:
            sizes = {
                name: bounds[pick] if bounds[pick] is not None else 2 * bounds[0] + 1
                for name, bounds in region["dims"].items()
            }
            text = ", ".join(f"{name}={size}" for name, size in sizes.items())
            out.append((f"region {region['file']} {label} ({text})", resized(plan, sizes)))
    return out


def _single(dims: dict[str, list[Any]]) -> bool:
    return all(low == high for low, high in dims.values())


def dynamic_info(plan: Any) -> dict[str, dict[str, Any]]:
    """``info()["dynamic"]``: each dim's range, and a derived one's rule (``"rule": "320*frames"``)."""
    from hatch_aoti.worker.inputs import rule_text

    out: dict[str, dict[str, Any]] = {name: {"min": lo, "max": hi} for name, (lo, hi) in plan.dims.items()}
    for name, rule in plan.rules.items():
        out[name]["rule"] = rule_text(*rule)
    return out


REMEMBERED = "(remembered from an earlier build)"
FOREIGN_CONTAINERS = (
    "its inputs or outputs are containers defined in {}: the installed loader imports that module to "
    "rebuild them, so the package that provides it is a run-time dependency"
)


def container_modules(exported: Any, *, named_only: bool = False) -> list[str]:
    """Modules that define the containers of a program's inputs and outputs (transformers'
    ``ModelOutput`` classes, say): a helper's ``torch.export.load`` needs them registered first,
    and a factory may import them only when it is called. ``named_only`` leaves out named
    tuples, which torch rebuilds from their fields alone."""
    found: list[str] = []
    specs = [exported.call_spec.in_spec, exported.call_spec.out_spec]
    while specs:
        spec = specs.pop()
        if spec is None:
            continue
        module = getattr(spec.type, "__module__", "builtins")
        named_tuple = isinstance(spec.type, type) and issubclass(spec.type, tuple) and hasattr(spec.type, "_fields")
        if module not in ("builtins", "collections", *found) and not (named_only and named_tuple):
            found.append(module)
        specs.extend(spec.children() if hasattr(spec, "children") else spec.children_specs)
    return found


def shipped_files(directory: Path, entry: dict[str, Any]) -> dict[str, str]:
    """sha256 of each of a model's files, reusing the digests its backend already made."""
    from hatch_aoti.pipeline.artifacts import file_hashes

    weights = entry.get("weights", {})
    known = {entry.get("file"): entry.get("sha256"), weights.get("file"): weights.get("sha256")}
    return file_hashes(directory, {k: v for k, v in known.items() if k and v})


def use_module_weights(module: Any, compiled: Any, directory: Path, weights: dict[str, Any]) -> None:
    """Let the compiled model run on the eager module's own weights while it is verified.

    The mapped weights file would otherwise be a second copy of them in memory (the
    module's cannot be freed: Inductor keeps references to them). Each weight the module
    has too is first compared, byte for byte, with its place in the file, read in chunks
    without mapping it, so the file that ships is checked all the same. Freezing renames
    the weights it keeps as they are (a linear layer's, transposed: a view of the same
    storage), so a constant is also matched to a module tensor holding its storage's bytes.
    """
    fqns = compiled.runner.get_constant_names_to_original_fqns()
    owners = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    constants = dict(compiled.weights)
    with (directory / weights["file"]).open("rb") as blob:
        storages = _StorageOwners(module.parameters(), blob)  # not buffers: the model may write them
        for constant, mapped in compiled.weights.items():
            if mapped.is_mkldnn:
                continue  # packed at load from a constant Inductor made: no module tensor holds it
            fqn = fqns.get(constant, "")
            own = owners.get(fqn)
            if own is None or (own.shape, own.stride(), own.dtype) != (mapped.shape, mapped.stride(), mapped.dtype):
                own = storages.view(mapped, weights["tensors"][fqn])  # one Inductor made or laid out anew
            elif not own.is_contiguous():
                own = None  # a view with gaps (a transposed slice, say): verified from the file
            elif not _same_bytes(own, blob, weights["tensors"][fqn]):
                raise RuntimeError(f"the shipped weights file holds other values for {fqn} than the model")
            if own is not None:
                constants[constant] = own.detach()
    compiled.runner.update_constant_buffer(constants, False, True, True)


class _StorageOwners:
    """The module's parameters that each hold a whole storage, found by a constant's storage in the file
    (indexed on first need)."""

    PREFIX = 64

    def __init__(self, tensors: Any, blob: Any) -> None:
        self.tensors, self.blob = list(tensors), blob
        self.found: dict[tuple[Any, int, bytes], list[Any]] | None = None

    def view(self, mapped: Any, place: dict[str, Any]) -> Any:
        """A parameter's storage viewed as ``mapped`` is, if its bytes are the file's; else None."""
        if self.found is None:
            self.found = {}
            for tensor in filter(_whole_storage, self.tensors):
                key = (tensor.dtype, tensor.nbytes, _head(tensor, self.PREFIX))
                self.found.setdefault(key, []).append(tensor)
        self.blob.seek(place["offset"])
        head = self.blob.read(min(self.PREFIX, place["nbytes"]))
        whole = {**place, "storage_offset": 0}
        for own in self.found.get((mapped.dtype, place["nbytes"], head), []):
            if _same_bytes(own, self.blob, whole):
                return own.as_strided(mapped.shape, mapped.stride(), place["storage_offset"])
        return None


def _whole_storage(tensor: Any) -> bool:
    """A dense CPU tensor, laid out from the start of its storage to its end."""
    import torch

    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return False  # sparse, mkldnn or a tensor subclass: no plain storage to compare
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.storage_offset() or not tensor.data_ptr():
        return False
    return bool(tensor.nbytes) and tensor.nbytes == tensor.untyped_storage().nbytes()


def _same_bytes(tensor: Any, blob: Any, place: dict[str, Any]) -> bool:
    import ctypes

    view = memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")
    blob.seek(place["offset"] + place["storage_offset"] * tensor.element_size())
    chunk = 1 << 24
    for start in range(0, len(view), chunk):
        if blob.read(min(chunk, len(view) - start)) != view[start : start + chunk]:
            return False
    return True


def _head(tensor: Any, size: int) -> bytes:
    import ctypes

    return ctypes.string_at(tensor.data_ptr(), min(size, tensor.nbytes))


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


CANNOT_SHARE = (
    "its exported program could not be saved for a compile process of its own, and it cannot be compiled "
    "beside this build's other models: one prepacks weights and the other does not, which Inductor decides "
    "once per process; build it on its own, or give the models the same `cpp.weight_prepack`"
)


def describe_rules(rules: dict[str, Any]) -> str:
    """``samples = 320*_samples, _samples in [10, 20]``."""
    return ", ".join(
        f"{name} = {value}"
        if isinstance(value, str)
        else f"{name} in [{value.min or 0}, {value.max if value.max is not None else 'inf'}]"
        for name, value in rules.items()
    )


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _summary(report: dict[str, Any] | None, errors: dict[str, float] | None) -> str:
    if not report or report.get("passed") is None:
        return "not verified (verify = false)"
    text = f"verified against eager on {len(report.get('tried', []))} input set(s)"
    if not errors:
        return text
    checked = " (float32 outputs checked against a float64 run)" if errors.get("float64_checked") else ""
    return f"{text}, max abs err {errors['max_abs_err']:.2g}{checked}"


def run(job: Job, parent: Parent) -> int:
    setup(job)
    Coordinator(job, parent).run(job.models)
    return 0


if __name__ == "__main__":
    from hatch_aoti.pipeline.children import child_main

    child_main(run, Job)
