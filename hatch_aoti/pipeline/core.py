"""The build, whatever the build system: settings and a project in, a staged package out.

Front ends (``frontends/``) call :func:`build`. It runs the coordinator process (torch is
never imported into the build backend), turns its events into progress lines, and returns
the staged loader and artifacts with the wheel's platform tag and torch requirement. A
failure raises :class:`ConfigError` or :class:`BuildFailed` with the whole story.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hatch_aoti.pipeline import protocol
from hatch_aoti.pipeline.children import INTERNAL_ERROR, Child, watch
from hatch_aoti.pipeline.progress import Progress
from hatch_aoti.settings.reader import ConfigError, model_path
from hatch_aoti.settings.spec import Settings
from hatch_aoti.store.owned import OwnedDir, sweep
from hatch_aoti.store.remote import Remote

ENV_JOBS = "HATCH_AOTI_JOBS"
#: Seconds between the lines that say a long stage is still running.
HEARTBEAT = 30.0
#: Seconds the coordinator has to exit after its last event (its exit handlers run).
EXIT_WAIT = 60.0


class BuildFailed(Exception):
    """A build error whose message is complete; shown without a traceback."""


@dataclass
class Reporter:
    """Where progress goes: each front end passes its own output functions."""

    info: Callable[[str], None] = print
    success: Callable[[str], None] = print
    warning: Callable[[str], None] = print


@dataclass
class Project:
    root: Path
    """The project directory: the coordinator runs there."""
    import_paths: list[str]
    """Where the project's packages import from (``src/`` layouts included)."""
    package: str
    """The package that receives the loader and the artifacts."""
    output: Path | None = None
    """Where the wheel goes (``dist/``), if the front end knows: external weights go beside it."""


@dataclass
class Staged:
    """What a front end puts in the wheel."""

    package_dir: Path
    """``<loader>.py`` and ``_aoti/``, to go into the target package."""
    torch_requirement: str
    platform_tag: str | None
    """``manylinux_2_X_<arch>`` (or ``linux_<arch>``); ``None`` for editable installs, which are not tagged here."""
    python_tag: str = "py3"
    """``py3``, or ``cpXY`` when an artifact is tied to one Python."""

    @property
    def tag(self) -> str:
        return f"{self.python_tag}-none-{self.platform_tag}"


# -- staging ----------------------------------------------------------------------------


def _stage_prefix(root: Path) -> str:
    return f"hatch-aoti-{hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:12]}-"


def open_stage(root: Path) -> OwnedDir:
    """A private staging directory for one build of the project at ``root``.

    It lives in the temp dir, locked while its build runs; leftovers of this project's
    killed builds are removed first.
    """
    clean_stages(root)
    return OwnedDir.create(Path(tempfile.gettempdir()), _stage_prefix(root))


def clean_stages(root: Path) -> list[Path]:
    """Remove staging left by builds of this project that are no longer running."""
    return sweep(Path(tempfile.gettempdir()), _stage_prefix(root))


# -- the build --------------------------------------------------------------------------


def build(settings: Settings, project: Project, stage: Path, report: Reporter, *, editable: bool = False) -> Staged:
    """Check, export, compile and verify every model into ``stage/package``."""
    from hatch_aoti.pipeline import tagging

    started = time.monotonic()
    torch_version = build_torch_version()
    pins = wheel_pins(settings, torch_version)
    jobs = jobs_from_env()
    cache = usable_cache(report)
    remote = remote_cache()
    count = len(settings.models)
    where = f"cache: {cache.root}" if cache else "cache disabled"
    if remote is not None:
        where += f"; remote cache: {remote.describe()}"
    report.info(f"aoti: building {count} model{'s' if count != 1 else ''} with AOTInductor ({where})")
    preparing = threading.Thread(target=tagging.prepare, name="hatch-aoti-tagging", daemon=True)
    preparing.start()  # loads the tagging tables while the coordinator works
    job = protocol.Job(
        models=list(settings.models),
        stage=str(stage),
        loader=settings.loader,
        package=project.package,
        sys_path=project.import_paths,
        cwd=str(project.root),
        cache=str(cache.root) if cache else None,
        cache_max_size=cache.max_size if cache else None,
        remote=remote,
        jobs=jobs,
    )
    coordination = Coordination(job, stage, settings, report)
    coordination.run()
    preparing.join()
    package = stage / "package"
    if not editable:
        from hatch_aoti.pipeline.external import NotWritten, publish

        try:
            publish(settings, project.root, project.output, package, report)
        except NotWritten as exc:
            raise BuildFailed(str(exc)) from None
    tag = None if editable else _tag(package)
    if tag is not None and tag[1]:
        report.warning(f"aoti: tagging the wheel {tag[0]}: {tag[1]}")
    report.success(coordination.progress.summary(time.monotonic() - started))
    return Staged(package, pins.torch, tag[0] if tag else None, pins.python_tag)


def build_torch_version() -> str:
    """The version of the torch that will compile the models, read without importing it."""
    if importlib.util.find_spec("torch") is None:
        raise BuildFailed(
            "torch is not installed in the build environment; add it to `[build-system] requires` "
            'in pyproject.toml, e.g. requires = ["hatchling", "hatch-aoti", "torch==2.13.*"]'
        )
    return importlib.metadata.version("torch")


def wheel_pins(settings: Settings, torch_version: str) -> Any:
    """What the wheel requires (torch, interpreter): the narrowest of its models' backends.

    ``torch-requirement`` replaces a backend's default torch series, never an exact pin,
    and must allow the build's torch. (What a backend cannot compile, the reader lists.)
    """
    from hatch_aoti import backends
    from hatch_aoti.pipeline.tagging import torch_series as series

    used: dict[str, backends.Backend] = {}
    for name in dict.fromkeys(m.backend for m in settings.models):
        try:
            used[name] = backends.get(name)
        except LookupError as exc:
            raise BuildFailed(str(exc)) from None
    user = torch_requirement(settings, torch_version)
    pins = [used[name].pins(torch_version) for name in used]
    for pin in pins:
        if pin.torch != series(torch_version) and not _pinned_as(settings.torch_requirement, pin.torch):
            raise ConfigError(
                [
                    (
                        f"{settings.table}.torch-requirement",
                        f"{user!r} allows other torch releases, but precompiled models load only under "
                        f'{pin.torch}: state "{pin.torch}", or leave the key out',
                    )
                ]
            )
    pins = [backends.Pins(user, p.python_tag) if p.torch == series(torch_version) else p for p in pins]
    try:
        return backends.combined_pins(pins)
    except ValueError as exc:
        raise BuildFailed(str(exc)) from None


def _pinned_as(requirement: str | None, pin: str) -> bool:
    """Whether ``requirement`` (None: not stated) allows no release but the one ``pin`` names."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    if requirement is None:
        return True
    (wanted,) = Requirement(pin).specifier
    exact = [s for s in Requirement(requirement).specifier if s.operator in ("==", "===") and "*" not in s.version]
    return any(Version(s.version).public == Version(wanted.version).public for s in exact)


def torch_requirement(settings: Settings, torch_version: str) -> str:
    """``Requires-Dist`` for torch: the user's, if it allows the build's torch, else ``torch==X.Y.*``."""
    from packaging.requirements import Requirement

    from hatch_aoti.pipeline.tagging import torch_series as series

    if settings.torch_requirement is None:
        return series(torch_version)
    if not Requirement(settings.torch_requirement).specifier.contains(torch_version, prereleases=True):
        raise ConfigError(
            [
                (
                    f"{settings.table}.torch-requirement",
                    f"{settings.torch_requirement!r} does not allow the torch in the build environment "
                    f"({torch_version}); the wheel would ask for a torch its models were not compiled "
                    "for. Change it, or the torch in `[build-system] requires`",
                )
            ]
        )
    if Requirement(settings.torch_requirement).specifier.contains("999", prereleases=True):
        raise ConfigError(
            [
                (
                    f"{settings.table}.torch-requirement",
                    f"{settings.torch_requirement!r} allows every later torch, but compiled models load only on "
                    f'the releases they were built for or verified with: state "{series(torch_version)}" (the '
                    "default), or a window with an upper bound checked with `hatch-aoti verify WHEEL --torch VERSION`",
                )
            ]
        )
    return settings.torch_requirement


def torch_to_add(
    dependencies: list[str],
    settings: Settings,
    needed: str,
    torch_version: str,
    *,
    can_add: bool,
    alternative: str = "",
) -> str | None:
    """The torch requirement the front end must add to the wheel's metadata, or ``None`` where the project
    states its own in ``[project] dependencies`` (checked against the build's torch and the models' pin).

    A wheel's metadata must equal what ``prepare_metadata_for_build_wheel`` gave the installer: a front
    end that cannot add the requirement there too (``can_add=False``: hatchling runs no build hook
    for it; PEP 621 makes static dependencies final) has the project state it, and is told the exact line.
    """
    from packaging.requirements import InvalidRequirement, Requirement

    declared = []
    for text in dependencies:
        with contextlib.suppress(InvalidRequirement):
            requirement = Requirement(text)
            if requirement.name.lower() == "torch" and (requirement.marker is None or requirement.marker.evaluate()):
                declared.append(requirement)
    if not declared:
        if can_add:
            return needed
        raise BuildFailed(
            f"project.dependencies: state the torch the wheel needs, so that the metadata installers "
            f'read before building (prepare_metadata_for_build_wheel) has it too: add "{needed}" to '
            f'[project] dependencies, e.g. dependencies = ["{needed}"]' + (f"; {alternative}" if alternative else "")
        )
    for requirement in declared:
        _check_declared(requirement, settings, needed, torch_version)
    return None


def _check_declared(requirement: Any, settings: Settings, needed: str, torch_version: str) -> None:
    from packaging.requirements import Requirement
    from packaging.version import Version

    where = f"project.dependencies: {str(requirement)!r}"
    if not requirement.specifier.contains(torch_version, prereleases=True):
        raise BuildFailed(
            f"{where} does not allow the torch in the build environment ({torch_version}), which "
            "compiles the models; change it, or the torch in `[build-system] requires`"
        )
    if requirement.specifier.contains("999", prereleases=True):
        raise BuildFailed(
            f"{where} allows every later torch, but compiled models load only on the releases they "
            f'were built for or verified with: state "{needed}" (the build\'s), or a window such as '
            f'"torch>={Version(torch_version).major}.{Version(torch_version).minor},<..." checked with '
            "`hatch-aoti verify WHEEL --torch VERSION`"
        )
    exact = [s for s in Requirement(needed).specifier if s.operator in ("==", "===") and "*" not in s.version]
    if needed != settings.torch_requirement and exact:
        pinned = [s for s in requirement.specifier if s.operator in ("==", "===") and "*" not in s.version]
        if not pinned or Version(pinned[0].version) != Version(exact[0].version):
            raise BuildFailed(
                f"{where} allows other torch releases, but precompiled models load only under "
                f'{needed}: state "{needed}"'
            )
    user = Requirement(settings.torch_requirement) if settings.torch_requirement is not None else None
    if user is not None and (user.specifier, user.marker) != (requirement.specifier, requirement.marker):
        raise BuildFailed(
            f"{where} and {settings.table}.torch-requirement ({settings.torch_requirement!r}) both "
            "state the torch requirement; keep the one in [project] dependencies"
        )


def jobs_from_env() -> int:
    raw = os.environ.get(ENV_JOBS, "")
    if raw.strip():
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise BuildFailed(f"{ENV_JOBS} must be a whole number >= 1, not {raw!r}")
        return value
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def remote_cache() -> Remote | None:
    """The remote tier the environment names (none while the cache is disabled); a bad setting fails the build."""
    from hatch_aoti.store import cache, remote

    if cache.disabled():
        return None
    try:
        return remote.from_env()
    except ValueError as exc:
        raise BuildFailed(str(exc)) from None


def usable_cache(report: Reporter) -> Any:
    """The compile cache, or ``None`` if disabled or not to be trusted (with a warning)."""
    from hatch_aoti.store import cache

    try:
        store = cache.from_env()
    except ValueError as exc:
        raise BuildFailed(str(exc)) from None
    if store is None:
        return None
    why = cache.untrusted(store.root)
    if why is not None:
        report.warning(
            f"aoti: not using the compile cache at {store.root}: {why}. Whoever can write there can "
            f"put code into the wheels built from it; fix this or set {cache.ENV_DIR}"
        )
        return None
    try:
        store.create()
    except OSError as exc:
        report.warning(f"aoti: not using the compile cache at {store.root}: cannot create it ({exc.strerror or exc})")
        return None
    return store


def _tag(package: Path) -> tuple[str, str | None]:
    """The platform tag from the compiled libraries; without any (no shared library
    shipped), the platform torch's own wheel was built for: the artifacts run where it does."""
    from elftools.common.exceptions import ELFError

    from hatch_aoti.pipeline import tagging
    from hatch_aoti.pipeline.artifacts import ARTIFACT_DIR

    libraries = sorted((package / ARTIFACT_DIR).rglob("*.so"))
    if not libraries:
        return tagging.torch_platform(), None
    try:
        return tagging.platform_tag(libraries, _torch_lib_dir())
    except (tagging.TagError, ELFError, OSError) as exc:
        raise BuildFailed(f"cannot tag the wheel from its compiled libraries: {exc}") from None


def _torch_lib_dir() -> Path:
    """``torch/lib`` of the build environment's torch, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) / "lib" if locations else Path("/nonexistent")


# -- the coordinator, seen from here --------------------------------------------------------


@dataclass
class Coordination:
    """One run of the coordinator process: its events as progress, its end as a result."""

    job: protocol.Job
    stage: Path
    settings: Settings
    report: Reporter
    argv: list[str] = field(default_factory=lambda: [sys.executable, "-m", "hatch_aoti.worker.coordinator"])
    problems: list[tuple[str, str]] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    built: set[str] = field(default_factory=set)
    doing: str = "starting"
    done: bool = False
    since: float = field(default_factory=time.monotonic)
    """When the current stage began: a long one is said to be alive every ``HEARTBEAT`` seconds."""
    progress: Progress = field(init=False)

    def __post_init__(self) -> None:
        self.progress = Progress([spec.name for spec in self.job.models])

    def run(self) -> None:
        job_file = self.stage / "job.json"
        protocol.write_job(self.job, job_file)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(self.stage / "inductor")}
        child = Child.start(
            "coordinator", [*self.argv, str(job_file)], cwd=self.job.cwd, log=self.stage / "coordinator.log", env=env
        )
        ended = threading.Event()
        heartbeat = threading.Thread(target=self.beat, args=(ended,), name="hatch-aoti-heartbeat", daemon=True)
        heartbeat.start()
        try:
            for _, event in watch([child]):
                if event is not None:
                    self.on_event(event)
                if self.done:  # the pipe may stay open in a process the factory started: the exit counts
                    break
            with contextlib.suppress(subprocess.TimeoutExpired):  # done, or its pipe closed: it is ending
                child.proc.wait(EXIT_WAIT)
        finally:
            ended.set()
            child.end()  # and whatever is left of its process group
        self.raise_for(child)

    def beat(self, ended: threading.Event) -> None:
        """A line every ``HEARTBEAT`` seconds while one stage lasts (a big model's compile takes minutes)."""
        while not ended.wait(HEARTBEAT):
            elapsed = time.monotonic() - self.since
            if elapsed >= HEARTBEAT:
                self.report.info(f"aoti: still {self.doing}: {elapsed:.0f}s so far")

    def on_event(self, event: protocol.Event) -> None:
        match event:
            case protocol.Stage(model, stage):
                self.doing, self.since = f"{_DOING[stage]} model {model!r}", time.monotonic()
                line = self.progress.entered(model, stage)
                if line is not None:
                    self.report.info(line)
            case protocol.Cached(model, seconds, check, tier):
                self.built.add(model)
                self.progress.came(model, tier)
                where = "the remote cache" if tier == "remote" else "cache"
                self.report.success(f"aoti: {self.progress.at(model)}: from {where} in {seconds:.1f}s, {check}")
            case protocol.Built(model, seconds, check):
                self.built.add(model)
                self.progress.came(model, None)
                self.report.success(f"aoti: {self.progress.at(model)}: compiled in {seconds:.1f}s, {check}")
            case protocol.Failed(model, stage, message):
                self.built.discard(model)
                self.progress.failed(model)
                self.failures[model] = f"model {model!r} ({self._model_path(model)}) failed at {stage}: {message}"
                self.report.warning(f"aoti: {self.progress.at(model)}: failed at {stage}")
            case protocol.Problems(problems):
                self.problems = problems
            case protocol.Notice(message):
                self.report.warning(f"aoti: warning: {message}")
            case protocol.Info(message):
                self.report.info(f"aoti: {message}")
            case protocol.Done():
                self.done = True

    def raise_for(self, child: Child) -> None:
        if self.problems:
            raise ConfigError(self.problems)
        failures = list(self.failures.values())
        if not self.done and child.proc.returncode == INTERNAL_ERROR:
            failures.append(
                f"internal error of hatch-aoti while {self.doing}: {_last_exception(child.log_tail())}; "
                f"the traceback is in its log, {child.log}:\n{child.log_tail()}"
            )
        elif not self.done:
            failures.append(
                f"the build coordinator {child.how_it_ended()} while {self.doing}; "
                f"last lines of its log:\n{child.log_tail()}"
            )
        if len(failures) == 1:
            raise BuildFailed(failures[0])
        if failures:
            head = f"{len(self.failures)} models failed" if self.done else "the build did not finish"
            n = len(self.built)
            stored = " and cached" if self.job.cache else ""
            kept = f"; {n} model{'s were' if n != 1 else ' was'} built{stored}" if n else ""
            lines = "\n".join(f"  - {message}" for message in failures)
            raise BuildFailed(f"{head}{kept}:\n{lines}")

    def _model_path(self, name: str) -> str:
        """The TOML path of a model, or of the model a variant (``name@bfloat16``) belongs to."""
        model = name.partition("@")[0]
        return next((m.path for m in self.settings.models if m.name == model), model_path(self.settings.table, model))


def _last_exception(tail: str) -> str:
    """The exception a traceback ends with (its last line that names one)."""
    lines = [line.removeprefix("  | ") for line in tail.splitlines()]
    named = [line for line in lines if line and not line.startswith(" ") and ("Error" in line or "Exception" in line)]
    return named[-1] if named else "an unexpected exception"


_DOING = {
    "check": "checking",
    "export": "exporting",
    "compile": "compiling",
    "verify": "verifying",
    "tune": "timing the candidates of",
    "store": "caching",
}
