"""What a command points at: a wheel file, an installed package, or a project directory.

Each becomes a :class:`Target`: the package directory holding the loader and ``_aoti/``
(a wheel is extracted to a temporary directory first: whole for commands that load
models, its small files only for ``inspect``), its manifest, and what the distribution
says of itself (tag, ``Requires-Dist``, ``RECORD``). Nothing of the package is imported
here; :meth:`Target.loader` loads the generated loader by path, for the commands that load models.
"""

from __future__ import annotations

import base64
import contextlib
import email.parser
import importlib.metadata
import importlib.util
import json
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from hatch_aoti.loader.schema import ARTIFACT_DIR, MANIFEST, Entry, Manifest
from hatch_aoti.pipeline.artifacts import import_package
from hatch_aoti.pipeline.manifest import read as read_manifest


class CliError(Exception):
    """A problem with what the user asked for: one line, exit status 2."""


@dataclass
class Dist:
    """What a distribution says of itself."""

    name: str = ""
    version: str = ""
    tags: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    record: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    """``RECORD``: path (relative to :attr:`base`) -> (sha256 in hex, or "", size)."""
    base: Path | None = None

    def digests(self) -> dict[Path, str]:
        """RECORD's sha256 digests (hex) by resolved path; empty where there is no RECORD."""
        if self.base is None:
            return {}
        return {(self.base / rel).resolve(): digest for rel, (digest, _) in self.record.items() if digest}


@dataclass
class Target:
    kind: str
    """``wheel``, ``installed`` or ``editable``."""
    where: str
    package: str
    loader_name: str
    package_dir: Path
    """Where the loader package ``<loader>/`` and ``_aoti/`` are."""
    manifest: Manifest
    dist: Dist
    import_root: Path | None = None
    """Put on ``sys.path`` to import the package's own code (a wheel's extracted files)."""
    sizes: dict[Path, int] = field(default_factory=dict)
    """Sizes of files a wheel holds but that were not extracted."""

    def size(self, path: Path) -> int | None:
        try:
            return path.stat().st_size
        except OSError:
            return self.sizes.get(path)

    @property
    def models(self) -> dict[str, Entry]:
        return self.manifest["models"]

    def model(self, name: str) -> Entry:
        if name not in self.models:
            raise CliError(f"no model {name!r} in {self.where}; its models: {', '.join(self.models) or 'none'}")
        return self.models[name]

    def loader(self) -> ModuleType:
        """The generated loader, loaded by path under its installed name (the package is not imported)."""
        name, path = f"{self.package}.{self.loader_name}", self.package_dir / self.loader_name
        if getattr(sys.modules.get(name), "__file__", None) == str(path / "__init__.py"):
            return sys.modules[name]
        if not (path / "__init__.py").is_file() and path.with_suffix(".py").is_file():
            raise CliError(
                f"{self.where}: its loader is one file ({self.loader_name}.py), as an earlier hatch-aoti wrote it; "
                "rebuild the wheel with this hatch-aoti to load its models"
            )
        try:
            return import_package(name, path)
        except ImportError as exc:
            raise CliError(str(exc)) from None

    def allow_package_code(self) -> None:
        """Let the package's own modules (factories) be imported: for ``--eager`` and precompiled models."""
        if self.import_root is not None and str(self.import_root) not in sys.path:
            sys.path.insert(0, str(self.import_root))


@contextlib.contextmanager
def open_target(text: str, extract: bool = True) -> Iterator[Target]:
    """The target ``text`` names; a wheel's temporary directory is removed afterwards.

    A directory is a project if it has ``pyproject.toml`` or ``dist/``; any other name is
    looked up as an installed package (a folder of that name in the current directory
    does not hide it).
    """
    path = Path(text)
    if text.endswith(".whl") or path.is_file():
        if not path.is_file():
            raise CliError(f"no such wheel: {text}")
        with tempfile.TemporaryDirectory(prefix="hatch-aoti-") as tmp:
            yield from_wheel(path, Path(tmp), extract)
        return
    if path.is_dir() and ((path / "pyproject.toml").is_file() or (path / "dist").is_dir()):
        with open_target(str(newest_wheel(path)), extract) as target:
            yield target
        return
    yield from_installed(text)


def newest_wheel(project: Path) -> Path:
    """The newest wheel in ``dist/`` of the project (by its name in ``pyproject.toml``, where it has one)."""
    from packaging.utils import (
        InvalidWheelFilename,
        canonicalize_name,
        parse_wheel_filename,
    )

    name = _project_name(project)
    wheels = []
    for wheel in (project / "dist").glob("*.whl"):
        with contextlib.suppress(InvalidWheelFilename):
            if name is None or parse_wheel_filename(wheel.name)[0] == canonicalize_name(name):
                wheels.append(wheel)
    if not wheels:
        raise CliError(
            f"no wheel{f' of {name}' if name else ''} in {project / 'dist'}: build one first "
            f"(python -m build {project})"
        )
    return max(wheels, key=lambda p: p.stat().st_mtime)


def _project_name(project: Path) -> str | None:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    try:
        name = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def from_wheel(wheel: Path, into: Path, extract: bool = True) -> Target:
    """The wheel, extracted into ``into`` (without its model files, unless ``extract``)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            infos = archive.infolist()
            manifests = sorted(i.filename for i in infos if i.filename.endswith(f"/{ARTIFACT_DIR}/{MANIFEST}"))
            if not manifests:
                raise CliError(f"{wheel} was not built by hatch-aoti: it has no {ARTIFACT_DIR}/{MANIFEST}")
            package = manifests[0].rsplit(f"/{ARTIFACT_DIR}/", 1)[0]
            models = f"{package}/{ARTIFACT_DIR}/"
            skipped = [] if extract else [i for i in infos if _model_file(i.filename, models)]
            archive.extractall(into, [i for i in infos if i not in skipped])
    except (zipfile.BadZipFile, OSError) as exc:
        raise CliError(f"cannot read {wheel} as a wheel: {exc}") from None
    target = _target("wheel", str(wheel), into / package, wheel_dist(into), import_root=into)
    target.sizes = {into / i.filename: i.file_size for i in skipped}
    return target


def _model_file(name: str, artifacts: str) -> bool:
    """Whether a wheel member is a model's file (``_aoti/<model>/...``), which ``inspect`` need not extract."""
    rest = name.removeprefix(artifacts)
    return rest != name and "/" in rest and not rest.startswith("runtime/")


def wheel_dist(root: Path) -> Dist:
    from importlib import metadata

    infos = sorted(root.glob("*.dist-info"))
    return from_distribution(metadata.PathDistribution(infos[0]), root) if infos else Dist(base=root)


def from_distribution(dist: importlib.metadata.Distribution, base: Path) -> Dist:
    """Name, version, tags, requirements and RECORD of a ``.dist-info``, through importlib.metadata."""
    wheel = email.parser.Parser().parsestr(dist.read_text("WHEEL") or "")
    record = {str(f): (_hex(f.hash), f.size) for f in dist.files or []}
    return Dist(dist.name or "", dist.version or "", wheel.get_all("Tag") or [], dist.requires or [], record, base)


def _hex(digest: importlib.metadata.FileHash | None) -> str:
    """RECORD's ``sha256=<urlsafe base64>`` as hex; "" for other algorithms or none."""
    if digest is None or digest.mode != "sha256" or not digest.value:
        return ""
    return base64.urlsafe_b64decode(digest.value + "=" * (-len(digest.value) % 4)).hex()


def from_installed(name: str) -> Target:
    """``my_pkg`` or ``my_pkg.compiled``, found on ``sys.path`` without importing anything."""
    parts = name.split(".")
    found = _package_dir(parts) if all(p.isidentifier() for p in parts) else None
    if found is None:
        raise CliError(f"no such wheel, directory or installed package: {name}")
    package_dir, package, loader = found
    kind = "installed"
    if not (package_dir / ARTIFACT_DIR / MANIFEST).is_file():
        editable = _package_dir([f"_hatch_aoti_{'_'.join(package)}"])
        if editable is None or not (editable[0] / ARTIFACT_DIR / MANIFEST).is_file():
            raise CliError(
                f"{name} has no models compiled by hatch-aoti (no {ARTIFACT_DIR}/{MANIFEST} in "
                f"{package_dir}){_below(package_dir, package)}"
            )
        package_dir, kind = editable[0], "editable"
    target = _target(kind, name, package_dir, installed_dist(parts[0], package_dir), package=".".join(package))
    if loader is not None and loader != target.loader_name:
        raise CliError(f"{name}: the compiled models' loader is {target.package}.{target.loader_name}, not {loader}")
    return target


def _below(package_dir: Path, package: list[str]) -> str:
    """A hint naming the subpackages that hold compiled models, if any."""
    try:
        manifests = sorted(package_dir.glob(f"*/**/{ARTIFACT_DIR}/{MANIFEST}"))[:5]
    except OSError:
        return ""
    names = [".".join([*package, *m.parent.parent.relative_to(package_dir).parts]) for m in manifests]
    return f"; models are compiled into {', '.join(names)}: name that instead" if names else ""


def _package_dir(parts: list[str]) -> tuple[Path, list[str], str | None] | None:
    """(directory, dotted name) of the package ``parts`` names, and the module named after it, if any."""
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    here, depth = Path(list(spec.submodule_search_locations)[0]), 1
    while depth < len(parts) and (here / parts[depth]).is_dir() and parts[depth] != _loader_of(here):
        here, depth = here / parts[depth], depth + 1
    rest = parts[depth:]
    if len(rest) > 1:
        return None
    return here, parts[:depth], rest[0] if rest else None


def _loader_of(package_dir: Path) -> str | None:
    """The name of the loader package of a package that holds compiled models (the manifest says)."""
    try:
        loader = json.loads((package_dir / ARTIFACT_DIR / MANIFEST).read_text(encoding="utf-8"))["loader"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return loader if isinstance(loader, str) else None


def installed_dist(top: str, package_dir: Path) -> Dist:
    """The installed distribution whose files hold the package (``Dist()`` if none does)."""
    from importlib import metadata

    owners = metadata.packages_distributions()
    for name in dict.fromkeys([*owners.get(top, []), *owners.get(package_dir.name, [])]):
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        if not any(
            (base / str(f)).resolve() == (package_dir / ARTIFACT_DIR / MANIFEST).resolve() for f in dist.files or []
        ):
            continue  # another copy of the package, elsewhere on sys.path
        return from_distribution(dist, base)
    return Dist()


def _target(
    kind: str, where: str, package_dir: Path, dist: Dist, *, import_root: Path | None = None, package: str = ""
) -> Target:
    """``package`` defaults to the manifest's."""
    try:
        manifest = read_manifest(package_dir)
    except ValueError as exc:
        raise CliError(f"{where}: {exc}") from None
    return Target(
        kind, where, package or manifest["package"], manifest["loader"], package_dir, manifest, dist, import_root
    )
