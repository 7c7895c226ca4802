"""The wheel's own files: the artifact directory, the manifest, the loader and its templates."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import ModuleType

from hatch_aoti import __version__
from hatch_aoti.loader.schema import ARTIFACT_DIR

#: The loader that every wheel gets as ``<package>/<loader>/``: hatch-aoti's own package, copied.
LOADER_SOURCE = Path(__file__).resolve().parents[1] / "loader"


def template_path(name: str) -> Path:
    """A template: the copy shipped as package data (``hatch_aoti/templates``), or in a checkout,
    where the package is the source tree, ``templates/`` beside it."""
    from importlib import resources

    shipped = resources.files("hatch_aoti").joinpath("templates").joinpath(name)
    path = Path(str(shipped)) if shipped.is_file() else Path(__file__).resolve().parents[2] / "templates" / name
    if not path.is_file():
        raise FileNotFoundError(f"hatch-aoti is installed without its template templates/{name}")
    return path


def editable_finder(module: str, file: str) -> str:
    """Source of the finder that maps ``module`` to ``file`` (relative to site-packages)."""
    text = template_path("editable_finder.py").read_text(encoding="utf-8")
    return text.replace("{{module}}", module).replace("{{file}}", file)


def write_runtime(package_dir: Path, backend: str, source: Path) -> None:
    """Ship a backend's run-time module as ``_aoti/runtime/<backend>.py`` (see ``hatch_aoti.backends``)."""
    dest = package_dir / ARTIFACT_DIR / "runtime" / f"{backend}.py"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    dest.chmod(0o644)


def editable_files(package: str, loader: str, staged: Path, stage: Path) -> dict[Path, str]:
    """What an editable install adds to site-packages, by source: the staged package as
    ``_hatch_aoti_<package>/``, and a ``.pth``-imported finder mapping ``<package>.<loader>`` there."""
    home = f"_hatch_aoti_{package.replace('.', '_')}"
    finder = stage / f"{home}_finder.py"
    finder.write_text(editable_finder(f"{package}.{loader}", f"{home}/{loader}/__init__.py"), encoding="utf-8")
    pth = stage / f"{home}.pth"
    pth.write_text(f"import {home}_finder\n", encoding="utf-8")
    return {staged: home, finder: finder.name, pth: pth.name}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(directory: Path, known: dict[str, str]) -> dict[str, str]:
    """sha256 of every file under ``directory`` by relative path (``known`` ones not read again):
    what ``hatch-aoti verify`` checks an installed model's files against."""
    return {
        rel: known.get(rel) or sha256(directory / rel)
        for rel in sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    }


def loader_modules() -> list[Path]:
    """The loader package's modules, in a fixed order."""
    return sorted(LOADER_SOURCE.glob("*.py"))


def write_loader(package_dir: Path, loader: str) -> None:
    """Write the loader package ``<loader>/`` into a staged package directory (its manifest:
    :mod:`hatch_aoti.pipeline.manifest`); each module says which hatch-aoti wrote it."""
    dest = package_dir / loader
    dest.mkdir(parents=True, exist_ok=True)
    header = f"# Written by hatch-aoti {__version__} for this package's compiled models; do not edit.\n"
    for source in loader_modules():
        (dest / source.name).write_text(header + source.read_text(encoding="utf-8"), encoding="utf-8")
        (dest / source.name).chmod(0o644)


def import_package(name: str, directory: Path) -> ModuleType:
    """The package in ``directory``, imported as ``name`` without importing its parent (a staged or
    extracted loader), and put in ``sys.modules`` so that its modules import each other. Modules of
    another package imported under that name before are dropped first: the new one's are its own."""
    import importlib.util
    import sys

    def forget() -> None:
        for key in [k for k in sys.modules if k == name or k.startswith(f"{name}.")]:
            del sys.modules[key]

    init = directory / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(directory)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {directory} as {name}")
    module = importlib.util.module_from_spec(spec)
    forget()
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        forget()
        raise
    return module
