"""The hatchling front end: the ``aoti`` build hook.

It finds the package that receives the models, runs the core build, and only after
every model compiled and verified touches ``build_data`` (tag, ``pure_python``,
``force_include``, ``dependencies``). Any failure aborts with a message before the wheel
is written, and the staging directory is removed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

#: Keys hatchling itself reads from every hook table; they are not ours to validate.
RESERVED_KEYS = frozenset(
    {"dependencies", "require-runtime-dependencies", "require-runtime-features", "enable-by-default"}
)


def hook_settings(config: dict[str, Any]) -> Any:
    """The hook table's settings (keys hatchling reads itself left out)."""
    from hatch_aoti import backends
    from hatch_aoti.settings.constants import HATCH_TABLE
    from hatch_aoti.settings.resolve import parse_settings

    table = {k: v for k, v in config.items() if k not in RESERVED_KEYS}
    return parse_settings(table, HATCH_TABLE, backend_check=backends.problems)


class AotiBuildHook(BuildHookInterface):
    PLUGIN_NAME = "aoti"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stage: Any = None

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        from hatch_aoti.pipeline.core import BuildFailed
        from hatch_aoti.settings.reader import ConfigError

        try:
            self._build(version, build_data)
        except (ConfigError, BuildFailed) as exc:
            self._cleanup()
            self.app.abort(str(exc) if isinstance(exc, ConfigError) else f"hatch-aoti: {exc}")
            raise  # abort() exits; this only runs if an app stub returns
        except BaseException:
            self._cleanup()
            raise

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        self._cleanup()

    def clean(self, versions: list[str]) -> None:
        """``hatch build --clean``: remove staging left by killed builds of this project (not the cache)."""
        from hatch_aoti.pipeline.core import clean_stages

        clean_stages(Path(self.root))

    def _cleanup(self) -> None:
        if self._stage is not None:
            self._stage.release()
            self._stage = None

    def _build(self, version: str, build_data: dict[str, Any]) -> None:
        from hatch_aoti.pipeline import core as pipeline

        settings = hook_settings(self.config)
        torch_version = pipeline.build_torch_version()
        needed = pipeline.wheel_pins(settings, torch_version).torch
        # hatchling's prepare_metadata_for_build_wheel runs no build hook: the project states torch itself.
        pipeline.torch_to_add(list(self.metadata.core.dependencies), settings, needed, torch_version, can_add=False)
        package, source_root = self._find_package(settings)
        self._stage = pipeline.open_stage(Path(self.root))
        report = pipeline.Reporter(self.app.display_info, self.app.display_success, self.app.display_warning)
        paths = list(dict.fromkeys([str(source_root), self.root]))
        project = pipeline.Project(Path(self.root), paths, package, output=Path(self.directory))
        staged = pipeline.build(settings, project, self._stage.path, report, editable=version == "editable")
        if version == "editable":
            self._editable(build_data, package, settings.loader, staged.package_dir)
            return
        from hatch_aoti.pipeline.artifacts import ARTIFACT_DIR

        dist_dir = package.replace(".", "/")
        build_data["pure_python"] = False
        build_data["tag"] = staged.tag
        build_data["force_include"][str(staged.package_dir / settings.loader)] = f"{dist_dir}/{settings.loader}"
        build_data["force_include"][str(staged.package_dir / ARTIFACT_DIR)] = f"{dist_dir}/{ARTIFACT_DIR}"

    def _find_package(self, settings: Any) -> tuple[str, Path]:
        """The package receiving the loader, and the directory to import it from."""
        from hatch_aoti.pipeline.core import BuildFailed

        top: dict[str, Path] = {}
        included_paths = set()
        for included in self.build_config.builder.recurse_selected_project_files():
            parts = Path(included.distribution_path).parts
            if len(parts) == 2 and parts[1] == "__init__.py":
                top[parts[0]] = Path(included.path).parent.parent
            included_paths.add(included.distribution_path.replace(os.sep, "/"))
        found = ", ".join(sorted(top)) or "none"
        if settings.package is None:
            if len(top) != 1:
                raise BuildFailed(
                    f"{settings.table}.package: cannot pick the package for the compiled models: the "
                    f'wheel has {len(top)} top-level packages ({found}); set `package = "..."`'
                )
            package = next(iter(top))
        else:
            package = settings.package
            if package.split(".")[0] not in top or f"{package.replace('.', '/')}/__init__.py" not in included_paths:
                raise BuildFailed(
                    f"{settings.table}.package: {package!r} is not a package in this wheel (found: {found})"
                )
        where = f"{package.replace('.', '/')}/{settings.loader}"
        clash = next((p for p in sorted(included_paths) if p == f"{where}.py" or p.startswith(f"{where}/")), None)
        if clash is not None:
            raise BuildFailed(
                f"{settings.table}.loader: {clash} already exists in the project; choose another `loader` name"
            )
        return package, top[package.split(".")[0]]

    def _editable(self, build_data: dict[str, Any], package: str, loader: str, staged: Path) -> None:
        """Editable installs import the package from the source tree, which we leave untouched.

        The loader and artifacts go to site-packages as ``_hatch_aoti_<package>/`` and a
        ``.pth``-registered finder maps ``<package>.<loader>`` there. Rebuild (reinstall)
        after changing a model, as with any compiled extension.
        """
        from hatch_aoti.pipeline.artifacts import editable_files

        include = build_data["force_include_editable"]
        if not include:
            include.update(self.build_config.get_force_include())
        for source, target in editable_files(package, loader, staged, self._stage.path).items():
            include[str(source)] = target
