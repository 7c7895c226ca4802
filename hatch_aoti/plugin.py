"""The ``aoti`` build hook: config → worker (export, compile, verify) → wheel contents.

The hook itself stays light: it validates the TOML, hands the models to a worker
process, and only after every model compiled and verified does it touch
``build_data`` (tag, ``pure_python``, ``force_include``, ``dependencies``). Any failure
aborts before the wheel is written, and the staging directory is removed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

from hatch_aoti.config import HOOK_PATH, ConfigError, HookSettings, parse_settings

LOG_TAIL_LINES = 40


class BuildFailed(Exception):
    """A build error whose message is complete; shown without a traceback."""


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
        self._stage = Path(tempfile.mkdtemp(prefix="hatch-aoti-"))
        torch_version = self._run_worker(settings, source_root)

        from hatch_aoti.artifacts import ARTIFACT_DIR
        from hatch_aoti.platform_tag import platform_tag, torch_requirement

        staged = self._stage / "package"
        libraries = sorted((staged / ARTIFACT_DIR).rglob("*.so"))
        dist_dir = package.replace(".", "/")
        loader_file = f"{settings.loader}.py"
        build_data["dependencies"].append(settings.torch_requirement or torch_requirement(torch_version))
        if version == "editable":
            self._editable(build_data, package, settings.loader, staged)
        else:
            build_data["pure_python"] = False
            build_data["tag"] = f"py3-none-{platform_tag(libraries)}"
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

    def _run_worker(self, settings: HookSettings, source_root: Path) -> str:
        assert self._stage is not None
        job = {
            "models": [m.to_json() for m in settings.models],
            "stage": str(self._stage),
            "loader": settings.loader,
            "sys_path": list(dict.fromkeys([str(source_root), self.root])),
        }
        job_file = self._stage / "job.json"
        job_file.write_text(json.dumps(job), encoding="utf-8")
        log_file = self._stage / "worker.log"
        count = len(settings.models)
        self.app.display_info(f"aoti: compiling {count} model{'s' if count != 1 else ''} with AOTInductor")

        read_fd, write_fd = os.pipe()
        env = {**os.environ, "HATCH_AOTI_EVENT_FD": str(write_fd), "PYTHONUNBUFFERED": "1"}
        with log_file.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hatch_aoti.worker", str(job_file)],
                cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                pass_fds=(write_fd,),
            )  # fmt: skip
            os.close(write_fd)
            result: dict[str, Any] = {}
            with os.fdopen(read_fd, encoding="utf-8") as events:
                for line in events:
                    self._on_event(json.loads(line), result)
            code = proc.wait()
        if "config_errors" in result:
            raise ConfigError([tuple(p) for p in result["config_errors"]])
        if "model_error" in result:
            err = result["model_error"]
            model_path = f"{HOOK_PATH}.models.{err['model']}"
            raise BuildFailed(f"model {err['model']!r} ({model_path}) failed at {err['stage']}: {err['message']}")
        if code != 0 or "done" not in result:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            raise BuildFailed(f"the compile worker {how}; last lines of its log:\n{_tail(log_file)}")
        return str(result["done"]["torch"])

    def _on_event(self, event: dict[str, Any], result: dict[str, Any]) -> None:
        kind = event.pop("event")
        if kind == "config_errors":
            result[kind] = event["problems"]
        elif kind in ("model_error", "done"):
            result[kind] = event
        elif kind == "model_compiled":
            result.setdefault("compile_seconds", {})[event["model"]] = event["seconds"]
        elif kind == "model_verified":
            name = event["model"]
            compiled = result.get("compile_seconds", {}).get(name, 0.0)
            if event.get("skipped"):
                check = "not verified (verify = false)"
            else:
                check = (f"verified against eager on {event['samples']} input set(s), "
                         f"max abs err {event['max_abs_err']:.2g}")
            self.app.display_success(f"aoti: {name}: compiled in {compiled:.1f}s, {check}")

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


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "  (no log)"
    return "\n".join(f"  | {line}" for line in lines[-LOG_TAIL_LINES:])
