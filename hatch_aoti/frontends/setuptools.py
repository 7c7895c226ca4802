"""The setuptools front end: ``[tool.hatch-aoti]`` in a setuptools project.

:func:`finalize` runs for every setuptools build where hatch-aoti is installed
(``setuptools.finalize_distribution_options``); without the table it returns at once and
changes nothing. With it, the project's command classes are extended, never replaced:
``build`` gains a ``build_aoti`` step that runs the core build and puts the loader and
artifacts into ``build_lib``, ``bdist_wheel`` tags the wheel from the compiled libraries,
and wheel metadata gets the torch requirement.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from setuptools import Command
from setuptools.errors import SetupError


def finalize(dist: Any) -> None:
    """Entry point: hook hatch-aoti into this build if its table is in ``pyproject.toml``."""
    document = _pyproject(Path(dist.src_root or os.curdir) / "pyproject.toml")
    tool = document.get("tool")
    table = tool.get("hatch-aoti") if isinstance(tool, dict) else None
    if table is None:
        return
    dist.hatch_aoti_table = table
    dist.hatch_aoti_can_add_torch = _dependencies_dynamic(document)
    dist.has_ext_modules = lambda: True  # native code: platform wheel, files in platlib
    dist.cmdclass["build_aoti"] = build_aoti
    for name, extend in (
        ("build", _build),
        ("bdist_wheel", _bdist_wheel),
        ("editable_wheel", _requiring_torch),
        ("dist_info", _requiring_torch),
    ):
        dist.cmdclass[name] = extend(dist.cmdclass.get(name) or _default(name))


def _pyproject(pyproject: Path) -> dict[str, Any]:
    """The parsed ``pyproject.toml``, or ``{}``; setuptools has not read its own config yet."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        with pyproject.open("rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError):
        return {}  # not ours to judge: setuptools reports a broken pyproject.toml itself


def _dependencies_dynamic(document: dict[str, Any]) -> bool:
    """Whether the build may add to the dependencies: PEP 621 makes a ``[project]`` table's
    ``dependencies`` final unless ``dynamic`` lists them, and installers such as uv resolve from it."""
    project = document.get("project")
    if not isinstance(project, dict):
        return True  # metadata from setup.py or setup.cfg: nothing static for an installer to read
    dynamic = project.get("dynamic")
    return isinstance(dynamic, list) and "dependencies" in dynamic


def _default(name: str) -> type:
    import importlib

    module = {
        "build": "build",
        "bdist_wheel": "bdist_wheel",
        "editable_wheel": "editable_wheel",
        "dist_info": "dist_info",
    }[name]
    return getattr(importlib.import_module(f"setuptools.command.{module}"), name)


def settings_of(dist: Any) -> Any:
    """The table's settings, read once per build; problems end the build without a traceback."""
    if not hasattr(dist, "hatch_aoti_settings"):
        from hatch_aoti import backends
        from hatch_aoti.settings.constants import SETUPTOOLS_TABLE
        from hatch_aoti.settings.reader import ConfigError
        from hatch_aoti.settings.resolve import parse_settings

        try:
            table = dist.hatch_aoti_table
            dist.hatch_aoti_settings = parse_settings(table, SETUPTOOLS_TABLE, backend_check=backends.problems)
        except ConfigError as exc:
            raise SetupError(str(exc)) from None
    return dist.hatch_aoti_settings


def _require_torch(dist: Any) -> None:
    """Add the torch the models were compiled for to the wheel's ``Requires-Dist``."""
    from hatch_aoti.pipeline.core import (
        BuildFailed,
        build_torch_version,
        torch_to_add,
        wheel_pins,
    )
    from hatch_aoti.settings.reader import ConfigError

    requires = list(dist.install_requires or ())
    try:
        settings, version = settings_of(dist), build_torch_version()
        requirement = torch_to_add(
            requires,
            settings,
            wheel_pins(settings, version).torch,
            version,
            can_add=dist.hatch_aoti_can_add_torch,
            alternative='or list "dependencies" in [project] dynamic for hatch-aoti to add it',
        )
    except (ConfigError, BuildFailed) as exc:
        raise SetupError(f"hatch-aoti: {exc}") from None
    if requirement is not None and requirement not in requires:
        dist.install_requires = dist.metadata.install_requires = [*requires, requirement]


def _requiring_torch(base: type[Any]) -> type:
    class command(base):
        def run(self) -> None:
            _require_torch(self.distribution)
            super().run()

    command.__name__ = base.__name__
    return command


def _build(base: type[Any]) -> type:
    class build(base):
        sub_commands = [*base.sub_commands, ("build_aoti", None)]

    return build


def _bdist_wheel(base: type) -> type:
    class bdist_wheel(_requiring_torch(base)):  # type: ignore[misc]
        def get_tag(self) -> tuple[str, str, str]:
            built = self.get_finalized_command("build_aoti")
            return (built.python_tag, "none", built.platform_tag) if built.platform_tag else super().get_tag()

    return bdist_wheel


class build_aoti(Command):
    """Compile the models declared in ``[tool.hatch-aoti]`` into ``build_lib``."""

    description = "compile the models declared in [tool.hatch-aoti] with AOTInductor"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False
        self.platform_tag: str | None = None
        self.python_tag = "py3"
        self._outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _output_dir(self) -> Path | None:
        """Where the wheel goes: bdist_wheel's directory, or the one it is moved to from setuptools'
        temporary directory inside it (``build_meta``'s ``.tmp-*``)."""
        if "bdist_wheel" not in self.distribution.command_obj:
            return None
        dist = Path(self.get_finalized_command("bdist_wheel").dist_dir).absolute()
        return dist.parent if dist.name.startswith(".tmp-") else dist

    def run(self) -> None:
        from hatch_aoti.pipeline import core as pipeline
        from hatch_aoti.settings.reader import ConfigError

        settings = settings_of(self.distribution)
        root = Path(self.distribution.src_root or os.curdir).absolute()
        try:
            package, import_root = self._package(settings, root)
            stage = pipeline.open_stage(root)
            try:
                report = pipeline.Reporter(self._info, self._info, self._warn)
                paths = list(dict.fromkeys([str(import_root), str(root)]))
                project = pipeline.Project(root, paths, package, output=self._output_dir())
                staged = pipeline.build(settings, project, stage.path, report, editable=self.editable_mode)
                self._place(staged, package, settings.loader, stage.path)
            finally:
                stage.release()
        except (ConfigError, pipeline.BuildFailed) as exc:
            raise SetupError(str(exc) if isinstance(exc, ConfigError) else f"hatch-aoti: {exc}") from None
        self.platform_tag = staged.platform_tag
        self.python_tag = staged.python_tag

    def get_outputs(self) -> list[str]:
        return list(self._outputs)

    def _place(self, staged: Any, package: str, loader: str, stage: Path) -> None:
        """The loader and artifacts into ``build_lib``, or, for an editable install, beside the source tree."""
        from hatch_aoti.pipeline.artifacts import editable_files

        for cache in list(staged.package_dir.rglob("__pycache__")):  # the build's own imports of the loader
            shutil.rmtree(cache)
        if self.editable_mode:  # setuptools puts what `install` holds into the editable wheel as is
            target = Path(str(self.get_finalized_command("install").install_lib))
            files = {
                src: target / name for src, name in editable_files(package, loader, staged.package_dir, stage).items()
            }
        else:
            target = Path(str(self.build_lib), *package.split("."))
            files = {staged.package_dir / p.name: target / p.name for p in staged.package_dir.iterdir()}
            (target / f"{loader}.py").unlink(missing_ok=True)  # an earlier build's one-file loader
        for source, dest in files.items():
            if dest.is_dir():
                shutil.rmtree(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(source), str(dest))
            self._outputs += [str(p) for p in ([dest] if dest.is_file() else dest.rglob("*")) if p.is_file()]

    def _package(self, settings: Any, root: Path) -> tuple[str, Path]:
        """The package receiving the loader, and the directory its top-level package imports from."""
        from hatch_aoti.pipeline.core import BuildFailed

        dist = self.distribution
        top = sorted({p.split(".")[0] for p in dist.packages or ()})
        found = ", ".join(top) or "none"
        package = settings.package
        if package is None:
            if len(top) != 1:
                raise BuildFailed(
                    f"{settings.table}.package: cannot pick the package for the compiled models: the "
                    f'wheel has {len(top)} top-level packages ({found}); set `package = "..."`'
                )
            package = top[0]
        elif package not in (dist.packages or ()):
            raise BuildFailed(f"{settings.table}.package: {package!r} is not a package in this wheel (found: {found})")
        package_dirs = dist.package_dir or {}
        first = package.split(".")[0]
        source = root / package_dirs[first] if first in package_dirs else root / package_dirs.get("", "") / first
        where = source.joinpath(*package.split(".")[1:])
        for clash in (where / f"{settings.loader}.py", where / settings.loader):
            if clash.exists():
                raise BuildFailed(
                    f"{settings.table}.loader: {clash.relative_to(root)} already exists in the "
                    "project; choose another `loader` name"
                )
        return package, source.parent

    def _info(self, message: str) -> None:
        from distutils import log

        log.info(message)

    def _warn(self, message: str) -> None:
        from distutils import log

        log.warn(message)
