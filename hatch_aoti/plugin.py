"""The ``aoti`` build hook: config → worker (export, compile, verify) → wheel contents.

The hook itself stays light: it validates the TOML, hands the models to worker
processes (torch is never imported here), and only after every model compiled and verified does it touch
``build_data`` (tag, ``pure_python``, ``force_include``, ``dependencies``). Any failure
aborts before the wheel is written, and the staging directory is removed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

from hatch_aoti.config import HOOK_PATH, ConfigError, HookSettings, parse_settings
from hatch_aoti.dispatch import BuildFailed


class AotiBuildHook(BuildHookInterface):
    PLUGIN_NAME = "aoti"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stage: Path | None = None

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        try:
            self._initialize(version, build_data)
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
        """``hatch build --clean``: remove staging left by killed builds of this project.

        Staging lives in the system temp dir and is removed after every build, so only an
        interrupted build leaves any. The shared compile cache is not touched.
        """
        for leftover in Path(tempfile.gettempdir()).glob(f"{self._stage_prefix()}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def _stage_prefix(self) -> str:
        import hashlib

        return f"hatch-aoti-{hashlib.sha256(os.path.abspath(self.root).encode()).hexdigest()[:12]}-"

    def _cleanup(self) -> None:
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None

    # -- steps -------------------------------------------------------------------------

    def _initialize(self, version: str, build_data: dict[str, Any]) -> None:
        settings = parse_settings(self.config)
        package, source_root = self._find_package(settings)
        if importlib.util.find_spec("torch") is None:
            raise BuildFailed(
                "torch is not installed in the build environment; add it to `[build-system] requires` "
                'in pyproject.toml, e.g. requires = ["hatchling", "hatch-aoti", "torch==2.13.*"]'
            )
        self._stage = Path(tempfile.mkdtemp(prefix=self._stage_prefix()))
        from hatch_aoti import platform_tag as tagging

        preparing = threading.Thread(target=tagging.prepare, name="hatch-aoti-tagging", daemon=True)
        preparing.start()  # the backend waits on the workers meanwhile
        torch_version = self._run_workers(settings, source_root)
        preparing.join()

        from hatch_aoti.artifacts import ARTIFACT_DIR

        staged = self._stage / "package"
        libraries = sorted((staged / ARTIFACT_DIR).rglob("*.so"))
        dist_dir = package.replace(".", "/")
        loader_file = f"{settings.loader}.py"
        build_data["dependencies"].append(settings.torch_requirement or tagging.torch_requirement(torch_version))
        if version == "editable":
            self._editable(build_data, package, settings.loader, staged)
        else:
            tag, why = tagging.platform_tag(libraries, _torch_lib_dir())
            if why:
                self.app.display_warning(f"aoti: tagging the wheel {tag}: {why}")
            build_data["pure_python"] = False
            build_data["tag"] = f"py3-none-{tag}"
            build_data["force_include"][str(staged / loader_file)] = f"{dist_dir}/{loader_file}"
            build_data["force_include"][str(staged / ARTIFACT_DIR)] = f"{dist_dir}/{ARTIFACT_DIR}"

    def _find_package(self, settings: HookSettings) -> tuple[str, Path]:
        """The package receiving the loader, and the directory to import it from."""
        top: dict[str, Path] = {}
        loader_paths = set()
        for included in self.build_config.builder.recurse_selected_project_files():
            parts = Path(included.distribution_path).parts
            if len(parts) == 2 and parts[1] == "__init__.py":
                top[parts[0]] = Path(included.path).parent.parent
            loader_paths.add(included.distribution_path.replace(os.sep, "/"))
        if settings.package is None:
            if len(top) != 1:
                found = ", ".join(sorted(top)) or "none"
                raise BuildFailed(
                    f"{HOOK_PATH}.package: cannot pick the package for the compiled models: the wheel has "
                    f"{len(top)} top-level packages ({found}); set `package = \"...\"`"
                )
            package = next(iter(top))
        else:
            package = settings.package
            if package.split(".")[0] not in top:
                found = ", ".join(sorted(top)) or "none"
                raise BuildFailed(f"{HOOK_PATH}.package: {package!r} is not a package in this wheel (found: {found})")
        clash = f"{package.replace('.', '/')}/{settings.loader}.py"
        if clash in loader_paths:
            raise BuildFailed(
                f"{HOOK_PATH}.loader: {clash} already exists in the project; choose another `loader` name"
            )
        return package, top[package.split(".")[0]]

    def _run_workers(self, settings: HookSettings, source_root: Path) -> str:
        from hatch_aoti import cache
        from hatch_aoti.dispatch import Dispatch

        assert self._stage is not None
        store = cache.from_env()
        count = len(settings.models)
        where = f"cache: {store.root}" if store else "cache disabled"
        self.app.display_info(f"aoti: building {count} model{'s' if count != 1 else ''} with AOTInductor ({where})")
        return Dispatch(
            models=list(settings.models),
            stage=self._stage,
            loader=settings.loader,
            sys_path=list(dict.fromkeys([str(source_root), self.root])),
            cwd=self.root,
            cache=store,
            report=self.app.display_success,
            project=self.metadata.name,
        ).run()

    def _editable(self, build_data: dict[str, Any], package: str, loader: str, staged: Path) -> None:
        """Editable installs import the package from the source tree, which we leave untouched.

        The loader and artifacts go to site-packages as ``_hatch_aoti_<package>/`` and a
        ``.pth``-registered finder maps ``<package>.<loader>`` there. Rebuild (reinstall)
        after changing a model, as with any compiled extension.
        """
        from hatch_aoti.artifacts import editable_finder

        key = package.replace(".", "_")
        home = f"_hatch_aoti_{key}"
        finder = self._stage / f"{home}_finder.py"
        finder.write_text(editable_finder(f"{package}.{loader}", f"{home}/{loader}.py"), encoding="utf-8")
        pth = self._stage / f"{home}.pth"
        pth.write_text(f"import {home}_finder\n", encoding="utf-8")
        include = build_data["force_include_editable"]
        if not include:
            include.update(self.build_config.get_force_include())
        include[str(staged)] = home
        include[str(finder)] = finder.name
        include[str(pth)] = pth.name


def _torch_lib_dir() -> Path:
    """``torch/lib`` of the build environment's torch, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) / "lib" if locations else Path("/nonexistent")
