"""The AOTInductor backend: an exported program compiled into a shared library that the loader maps in place."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hatch_aoti.backends.interface import Backend, Request

if TYPE_CHECKING:
    from hatch_aoti.settings.config import ModelSpec
    from hatch_aoti.settings.cpu_targets import CpuTarget


class AotiBackend(Backend):
    """The default: ``aoti_compile_and_package``, unpacked; no Python tracing or compiling at run time."""

    name = "aoti"
    in_helpers = True

    def settings(self, user_configs: dict[str, Any], target: CpuTarget, spec: ModelSpec) -> dict[str, Any]:
        mapped = MAPPED_WEIGHTS if spec.weights == "mapped" and spec.device == "cpu" else {}
        return inductor_configs({**mapped, **user_configs}, target)

    def compile(self, request: Request) -> dict[str, Any]:
        return compile_program(request.exported, request.out, request.settings, request.work)


#: Where hatch-aoti departs from Inductor's defaults, for code that ships in wheels:
#: - line tables (``-g1``) triple the size of a small model's library and carry build
#:   paths; release builds of torch itself ship without them;
#: - without dynamic threads, Inductor writes the build machine's thread count into the
#:   kernels (one thread: no parallel loops at all), so the library would run with the
#:   build machine's parallelism everywhere, and its bytes would depend on it;
#: - a fixed name for the generated files, which are otherwise named by a digest that
#:   includes the build's paths.
#: ``inductor-configs`` can change any of them.
#: ``weights = "mapped"`` (CPU models): the weights stay out of the library, in a file the
#: loader maps instead of copying (see ``artifacts.py``).
MAPPED_WEIGHTS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}
WHEEL_DEFAULTS: dict[str, Any] = {
    "aot_inductor.enable_line_tables": False,
    "cpp.dynamic_threads": True,
    "aot_inductor.model_name_for_generated_files": "model",
}


def inductor_configs(user_configs: dict[str, Any], target: CpuTarget) -> dict[str, Any]:
    """The settings a model compiles with: wheel defaults, then its CPU target's, then the user's."""
    import torch._inductor.config

    known = set(torch._inductor.config.get_config_copy())
    defaults = {k: v for k, v in WHEEL_DEFAULTS.items() if k in known}  # older releases lack some
    if getattr(torch._inductor.config.cpp, "enable_kernel_profile", False):  # TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE
        defaults["cpp.enable_kernel_profile"] = True  # recorded, so `hatch-aoti inspect` and `profile` see it
    # The target applies to CUDA models too: their wrapper is CPU code built with -march.
    return {**defaults, **target.inductor_configs, **user_configs}


def compile_program(exported: Any, out_dir: Path, configs: dict[str, Any], work: Path) -> dict[str, Any]:
    """Compile ``exported`` and lay its files out in ``out_dir``; the manifest entry's file fields.

    Each compile gets an Inductor cache of its own under ``work``: the generated files
    have fixed names, and Inductor reuses a library it finds under the same name, which
    would be another model's when two models share their graph code (layers of other sizes).
    """
    import shutil

    import torch._inductor
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from hatch_aoti.backends.pt2 import unpack_pt2

    use_header_store()
    pt2, inductor = work / "model.pt2", work / "inductor"
    shutil.rmtree(inductor, ignore_errors=True)
    try:
        with temporary_cache_dir(str(inductor)), portable_paths():
            torch._inductor.aoti_compile_and_package(exported, package_path=str(pt2), inductor_configs=dict(configs))
        return unpack_pt2(pt2, out_dir)
    finally:
        pt2.unlink(missing_ok=True)
        shutil.rmtree(inductor, ignore_errors=True)


def use_header_store() -> None:
    """Keep Inductor's precompiled headers in its usual place, but one directory per torch install.

    They take about 280 MB per torch install and are keyed by its path; Inductor keeps
    them forever, so every isolated build (a new environment each time) would leave its
    own copy behind. Here the headers of installs that no longer exist are removed, and a
    long-lived environment keeps reusing its own (about 9 s a build).
    """
    import hashlib
    import shutil

    import torch
    from torch._inductor import codecache

    if not hasattr(codecache, "_HEADER_DIR") or getattr(codecache, "_hatch_aoti_headers", False):
        return
    root = Path(codecache._HEADER_DIR) / "hatch-aoti"
    install = os.path.dirname(os.path.abspath(torch.__file__))
    with contextlib.suppress(OSError):
        for other in root.iterdir():
            owner = other / "torch-path"
            if owner.is_file() and not Path(owner.read_text(encoding="utf-8")).exists():
                shutil.rmtree(other, ignore_errors=True)
    home = root / hashlib.sha256(install.encode()).hexdigest()[:16]
    try:
        home.mkdir(parents=True, exist_ok=True)
        (home / "torch-path").write_text(install, encoding="utf-8")
    except OSError:
        return  # Inductor's own location still works
    codecache._HEADER_DIR = str(home)
    codecache._HEADER_LOCK_DIR = str(home / "locks")
    codecache._hatch_aoti_headers = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def portable_paths() -> Iterator[None]:
    """Keep the build's directories out of the compiled code (``-ffile-prefix-map``).

    Headers and generated sources are named by ``__FILE__`` in the library, and their
    paths depend on where the build runs (torch's location in an isolated build, the
    Inductor cache), so without this two builds of the same sources would differ. Inductor
    has no setting for extra compiler flags, so its command builder is wrapped. The map of
    the Inductor cache (a fresh directory in every build) goes only to the commands that
    compile its sources: in every command, it would change the key of Inductor's
    precompiled headers and make each build compile them again (about 9 s here).
    """
    import torch
    from torch._inductor import cpp_builder
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    flags_of = getattr(cpp_builder, "_get_optimization_cflags", None)
    builder = getattr(cpp_builder, "CppBuilder", None)
    command_of = getattr(builder, "get_command_line", None)
    if flags_of is None or command_of is None:  # a torch that builds commands differently
        yield  # builds stay correct, but not free of paths
        return
    stable = _prefix_maps({sys.base_prefix: "python", sys.prefix: "env", os.path.dirname(torch.__file__): "torch"})
    inductor = cache_dir()
    generated = " ".join(f"-{flag}" for flag in _prefix_maps({inductor: "inductor"}))

    def flags(*args: Any, **kwargs: Any) -> Any:
        cflags, ldflags = flags_of(*args, **kwargs)
        return [*cflags, *stable], ldflags

    def command(self: Any) -> str:
        line = command_of(self)
        sources = str(getattr(self, "_sources_args", ""))
        return f"{line} {generated}" if inductor in sources and "c++-header" not in sources else line

    cpp_builder._get_optimization_cflags = flags
    builder.get_command_line = command  # type: ignore[union-attr]
    try:
        yield
    finally:
        cpp_builder._get_optimization_cflags = flags_of
        builder.get_command_line = command_of  # type: ignore[union-attr]


def _prefix_maps(maps: dict[str, str]) -> list[str]:
    """``ffile-prefix-map`` flags for each directory as given and as resolved; broadest first,
    since for a path under several of them the last match wins."""
    out: list[str] = []
    for old, new in sorted(maps.items(), key=lambda item: len(item[0])):
        for path in dict.fromkeys([old, os.path.realpath(old)]):
            out.append(f"ffile-prefix-map={path}={new}")
    return out
