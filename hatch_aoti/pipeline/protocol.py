"""What the build's processes tell each other: the jobs they start with and the events they send back.

Every message is a frozen dataclass; :func:`encode` and :func:`decode` are the one codec (a JSON
line whose ``event`` names the class). The build backend starts the coordinator with a
:class:`Job`; the coordinator starts compile helpers with a :class:`HelperJob` of :class:`Task`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hatch_aoti.settings.spec import ModelSpec
from hatch_aoti.store.remote import Remote

# -- jobs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """The coordinator's: the models, where to stage them, and what the project's code needs to import."""

    models: list[ModelSpec]
    stage: str
    loader: str
    package: str
    sys_path: list[str]
    cwd: str
    cache: str | None
    cache_max_size: int | None
    remote: Remote | None
    """The compile cache's remote tier, if the environment names one."""
    jobs: int


@dataclass(frozen=True)
class Task:
    """One model for a compile helper."""

    model: str
    backend: str
    program: str
    """A saved ExportedProgram (``torch.export.save``)."""
    out: str
    """Directory that receives the unpacked artifact."""
    inductor_configs: dict[str, Any]
    """What the backend's ``settings`` gave for the model (the manifest's ``inductor_configs``)."""
    modules: list[str]
    """Modules to import first (custom ops register there)."""


@dataclass(frozen=True)
class HelperJob:
    """A compile helper's: its tasks, its scratch directory, and the coordinator's import setup."""

    tasks: list[Task]
    work: str
    sys_path: list[str]
    cwd: str
    cache: str | None


AnyJob = TypeVar("AnyJob", Job, HelperJob)


def write_job(job: Job | HelperJob, path: Path) -> None:
    path.write_text(json.dumps(dataclasses.asdict(job)), encoding="utf-8")


def read_job(kind: type[AnyJob], path: Path) -> AnyJob:
    data = json.loads(path.read_text(encoding="utf-8"))
    if kind is Job:
        data["models"] = [ModelSpec.from_json(m) for m in data["models"]]
        data["remote"] = Remote(**data["remote"]) if data["remote"] is not None else None
    else:
        data["tasks"] = [Task(**t) for t in data["tasks"]]
    return kind(**data)


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """A model enters a stage: ``check``, ``export``, ``compile``, ``verify``, ``tune``, ``store``."""

    model: str
    stage: str


@dataclass(frozen=True)
class Cached:
    """A model came from the compile cache: its ``tier``, ``local`` or ``remote``."""

    model: str
    seconds: float
    check: str
    tier: str = "local"


@dataclass(frozen=True)
class Built:
    """A model was compiled, verified and staged."""

    model: str
    seconds: float
    check: str


@dataclass(frozen=True)
class Compiled:
    """A compile helper's model compiled: the manifest entry's fields about its files."""

    model: str
    seconds: float
    files: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """A model failed at a stage; the others go on."""

    model: str
    stage: str
    message: str
    lasting: bool = False
    """The compile itself failed (not the process running it, nor the disk): it would fail again."""


@dataclass(frozen=True)
class Problems:
    """Configuration problems, (TOML path, message), found before anything was exported."""

    problems: list[tuple[str, str]]


@dataclass(frozen=True)
class Notice:
    """Something the user should know that does not fail the build (an unreadable cache, say)."""

    message: str


@dataclass(frozen=True)
class Info:
    message: str


@dataclass(frozen=True)
class Done:
    """The coordinator finished: every model built or failed."""

    torch: str
    built: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


Event = Stage | Cached | Built | Compiled | Failed | Problems | Notice | Info | Done
EVENTS: dict[str, type[Event]] = {
    cls.__name__.lower(): cls for cls in (Stage, Cached, Built, Compiled, Failed, Problems, Notice, Info, Done)
}


def encode(event: Event) -> str:
    """One JSON line."""
    return json.dumps({"event": type(event).__name__.lower(), **dataclasses.asdict(event)})


def decode(line: str | bytes) -> Event:
    """The event a line holds; a :class:`ValueError` for anything else."""
    data = json.loads(line)
    kind = EVENTS.get(data.pop("event", None)) if isinstance(data, dict) else None
    if kind is None:
        raise ValueError(f"not a build event: {line!r}")
    if kind is Problems:
        data["problems"] = [tuple(p) for p in data["problems"]]
    return kind(**data)
