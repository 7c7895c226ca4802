"""The coordinator: the one process of a build that imports torch and the project's models.

Run as ``python -m hatch_aoti.worker.coordinator JOB`` by the build backend (``pipeline/core.py``):
1. check every model before anything is exported; any problem ends the build, all of them listed;
2. export each model and key it from the exported program; cache hits go straight to the staged package;
3. compile the misses: one share here, the others in compile helpers started for them (``helpers.py``);
4. verify each compiled model against eager through the staged loader, and cache it once it passes;
5. a model that fails never stops the others; the last event says which built and which failed.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hatch_aoti.backends.interface import ProgramFacts
from hatch_aoti.loader.host import ENVIRONMENT
from hatch_aoti.pipeline import protocol
from hatch_aoti.pipeline.children import Parent
from hatch_aoti.pipeline.protocol import HelperJob, Job, Task
from hatch_aoti.settings.spec import ModelSpec
from hatch_aoti.store.cache import NoSpace, out_of_space
from hatch_aoti.worker.bootstrap import hand_back_freed, setup
from hatch_aoti.worker.checks import Prepared, check_model
from hatch_aoti.worker.facts import program_facts, resolved_weights, weights_size
from hatch_aoti.worker.helpers import Helpers, Outcome, lasting
from hatch_aoti.worker.split import Miss, mixes_packing, processes
from hatch_aoti.worker.tuning import Tuner


class ModelFailure(Exception):
    def __init__(self, stage: str, message: str, *, lasting: bool = False) -> None:
        self.stage, self.lasting = stage, lasting  # lasting: the same inputs would fail the same way
        super().__init__(message)


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
        self.facts: dict[str, ProgramFacts] = {}
        """What each model's exported program says of it, by model."""
        self.quantized: dict[str, str] = {}
        """What each ``int8`` variant's quantizer took, as the log says it."""
        self.uses: dict[str, list[str]] = {}
        """The precisions besides its own each variant computes in, where there are any."""
        self.tuner = Tuner(self)

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
        from hatch_aoti.worker.precision import variants

        os.environ.pop(ENVIRONMENT, None)  # the build's own loads take each variant by its folder
        self.signatures.update({model.spec.name: model.signature for model in prepared})
        each = [variants(model) for model in prepared]  # each variant built as a model
        for note in (note for _, notes in each for note in notes):
            self.emit(protocol.Info(note))
        prepared = [variant for found, _ in each for variant in found]
        misses = [m for model in prepared for m in self.export_and_look_up(model)]
        hand_back_freed()  # what export traced
        self.compile(misses)
        self.tuner.time_candidates(prepared)
        if not self.failed:
            self.write_manifest({s.name: self.variant_entry(s) for s in specs})
        self.emit(protocol.Done(_torch_version(), list(self.entries), list(self.failed)))

    def variant_entry(self, spec: ModelSpec) -> dict[str, Any]:
        """A model's entry in the manifest: its first variant's, with the others after it."""
        if spec.precision == ("float32",):
            return self.entries[spec.name]
        found = [
            {
                **self.entries[label],
                "precision": precision,
                "factory": spec.factory,
                "signature": self.signatures[label],
            }
            for label, precision in spec.variants
        ]
        return {**found[0], "variants": found[1:]} if len(found) > 1 else found[0]

    # -- export, key, cache ---------------------------------------------------------------

    def export_and_look_up(self, model: Prepared) -> list[Miss]:
        """Export the model and look it up (each candidate, if it is tuned); what is left to compile."""
        from hatch_aoti import backends
        from hatch_aoti.backends.aoti import packs_weights
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
        packed_in_library = settings.get("freezing") and not packs_weights(settings)  # by torchao's passes
        if spec.precision[0] == "int8" and spec.weights != "embedded" and packed_in_library:
            self.emit(protocol.Info(f"{spec.name}: {INT8_WEIGHTS.format(spec.weights)}"))
            spec = model.spec = dataclasses.replace(spec, weights="embedded", weights_url=None)
            settings = backend.settings(model.user_configs, cpu, spec, facts)
        if not spec.tune:
            miss = self.look_up(model, exported, backend, cpu, spec.name, settings, start)
            return [miss] if miss else []
        found = tuning.candidates(settings, model.user_configs)
        self.tuner.begin(spec.name, list(found), start)
        self.emit(protocol.Info(f"{spec.name}: tuning {len(found)} candidates: {', '.join(found)}"))
        misses = []
        for name, configs in found.items():
            label = f"{spec.name}{tuning.SEPARATOR}{name}"
            miss = self.look_up(model, exported, backend, cpu, label, configs, start)
            misses += [miss] if miss else []
        self.tuner.finish(spec.name)  # every candidate was cached, or failed already
        return misses

    def name_foreign_containers(self, name: str, exported: Any) -> None:
        """Say which other packages the installed loader imports to rebuild the model's containers."""
        from hatch_aoti.worker.entry import container_modules

        found = [m for m in container_modules(exported, named_only=True) if m.partition(".")[0] != "torch"]
        foreign = [m for m in found if m.partition(".")[0] != self.job.package.partition(".")[0]]
        if foreign:  # the project's own package is no dependency
            self.emit(protocol.Info(f"{name}: {FOREIGN_CONTAINERS.format(', '.join(foreign))}"))

    def look_up(
        self, model: Prepared, exported: Any, backend: Any, cpu: Any, label: str, configs: dict[str, Any], start: float
    ) -> Miss | None:
        """The model (or candidate ``label``) from the cache, staged; else what compiling it needs."""
        from hatch_aoti.worker.entry import call_spec, describe_call, describe_outputs, dynamic_info
        from hatch_aoti.worker.fingerprint import cache_key
        from hatch_aoti.worker.verify import summary

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
                check = summary(entry["verification"], record.get("errors"))
                self.emit(protocol.Cached(spec.name, time.perf_counter() - start, check, tier))
                return None
            if self.tuner.cached_candidate(Miss(model, exported, key, entry, backend, label), record, tier):
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
        if spec.name in self.quantized:
            entry["quantized"] = self.quantized[spec.name]
        if self.uses.get(spec.name):
            entry["uses"] = self.uses[spec.name]
        return Miss(model, exported, key, entry, backend, label)

    def export(self, model: Prepared) -> Any:
        """``torch.export``; where it finds that dims are related (a length that must be a multiple of a
        frame), the relations it suggests are applied and the model exported again."""
        from hatch_aoti.worker import precision

        for attempt in range(3):
            args, kwargs = model.plan.export_sample
            try:
                exported, quantized, uses = precision.export(model, args, kwargs, model.plan.dynamic_shapes)
            except Exception as exc:
                failure = ModelFailure("export", f"torch.export failed: {type(exc).__name__}: {exc}")
                if attempt == 2 or not self.apply_suggested_rules(model, str(exc)):
                    raise failure from None
            else:
                self.uses[model.spec.name] = uses
                if quantized is not None:
                    self.quantized[model.spec.name] = quantized
                    self.emit(protocol.Info(f"{model.spec.name}: {quantized}"))
                return exported
        raise AssertionError("unreachable")

    def apply_suggested_rules(self, model: Prepared, message: str) -> bool:
        """The model's plan again with the rules torch suggests; False where there are none to apply, or
        its backend cannot take them, or they do not fit its samples."""
        from hatch_aoti import backends
        from hatch_aoti.worker.inputs import describe_rules, suggested_rules

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
        for task in (task for group in tasks for task in group):  # the helpers' models compile from now on
            self.emit(protocol.Stage(by_name[task.model].name, "compile"))
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

        from hatch_aoti.worker.entry import container_modules

        program = self.stage / "programs" / f"{miss.label}.pt2"
        program.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.export.save(miss.exported, program)
        except Exception:
            return None
        from hatch_aoti.worker.precision import lowering_modules

        modules = [
            miss.model.spec.factory.partition(":")[0],
            *container_modules(miss.exported),
            *lowering_modules(miss.model),
        ]
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
        from hatch_aoti.worker.entry import shipped_files
        from hatch_aoti.worker.verify import summary

        if outcome.error is not None:
            self.fail_or_drop(miss, "compile", outcome.error, lasting=outcome.lasting)
            return
        hand_back_freed()  # what the compile built: verification's peak comes on top of what is left
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
            self.tuner.verified(miss, entry, errors)
            return
        if not self.store(miss, {"entry": entry, "errors": errors}):
            return
        self.entries[miss.name] = entry
        elapsed = outcome.seconds + time.perf_counter() - start
        self.emit(protocol.Built(miss.name, elapsed, summary(entry["verification"], errors)))

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
        from hatch_aoti.worker.module_weights import use_module_weights
        from hatch_aoti.worker.precision import limits, precision_of, verify_variant
        from hatch_aoti.worker.verify import VerificationFailed, rebuilt_unlike, region_edges, verify_model

        spec = miss.model.spec
        if not spec.verify:
            return {"passed": None, "skipped": "verify = false"}, None
        loader = self.staged_loader({miss.label: entry})  # no precision yet: verified on any CPU
        lower = precision_of(miss.model) != "float32"
        try:
            compiled = loader.load(miss.label)
            if "weights" in entry and getattr(compiled, "weights", None) and not lower:  # mapped, not only packed
                use_module_weights(miss.model.module, compiled, self.artifacts / miss.label, entry["weights"])
            plan = miss.model.plan
            samples = [*plan.verify_samples, *region_edges(plan, entry.get("regions", []))]
            if lower:  # against float32 eager, on the calibration samples too
                samples += [(f"calibration sample {i}", s) for i, s in enumerate(miss.model.calibration)]
                check = limits(miss.model)
                report, worst = verify_variant(miss.model.module, samples, compiled, precision_of(miss.model), check)
            else:
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

    def fail_or_drop(self, miss: Miss, stage: str, message: str, *, lasting: bool = False) -> None:
        """A model fails; a candidate is only dropped (see :meth:`Tuner.drop`)."""
        if not miss.candidate:
            self.fail(miss.name, stage, message)
            return
        self.tuner.drop(miss, stage, message, lasting=lasting)

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
        """A fresh import of the loader that ships, over a manifest holding ``models``: verification uses it.
        It reads the manifest now, since the next staged loader writes another over it."""
        from hatch_aoti.pipeline.artifacts import import_package

        self.write_manifest(models)
        loader = import_package(f"_hatch_aoti_staged_{next(_STAGED)}", self.package / self.job.loader)
        loader.names()
        return loader


#: Each staged loader's import name is its own: candidates of a tuned model are loaded side by side.
_STAGED = itertools.count()


FOREIGN_CONTAINERS = (
    "its inputs or outputs are containers defined in {}: the installed loader imports that module to "
    "rebuild them, so the package that provides it is a run-time dependency"
)


INT8_WEIGHTS = (
    "its weights are in the library, not {} (`weights`): it freezes without `cpp.weight_prepack` (set in "
    "`inductor-configs`, or off for transposed convolutions), so oneDNN packs its int8 weights as it "
    "compiles, into tensors that only the library can hold"
)


CANNOT_SHARE = (
    "its exported program could not be saved for a compile process of its own, and it cannot be compiled "
    "beside this build's other models: one prepacks weights and the other does not, which Inductor decides "
    "once per process; build it on its own, or give the models the same `cpp.weight_prepack`"
)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def run(job: Job, parent: Parent) -> int:
    setup(job)
    Coordinator(job, parent).run(job.models)
    return 0


if __name__ == "__main__":
    from hatch_aoti.pipeline.children import child_main

    child_main(run, Job)
