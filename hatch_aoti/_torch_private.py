"""The build's uses of torch internals that no release documents, in one place: each says why it is
needed and what happens on a torch that lacks it, and ``tests/test_torch_private.py`` checks each
on the installed torch and the next one. Checked on torch 2.13.0 and 2.14.1.

Not here: Inductor's config module (``torch._inductor.config``, the documented way to set it),
``torch.utils._pytree``, and the generated loader's own, which must stay torch plus the
standard library (its direct runner, ``torch._C._aoti``, falls back to ``aoti_load_package``).
Imported by the worker only; each function imports torch.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHECKED_ON = ("2.13.0", "2.14.1")


@contextlib.contextmanager
def inductor_cache(directory: Path) -> Iterator[None]:
    """Inductor's cache in ``directory`` for one compile (``cache_dir_utils.temporary_cache_dir``)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with temporary_cache_dir(str(directory)):
        yield


def cpp_compiler() -> str:
    """The C++ compiler AOTInductor will call (``cpp_builder.get_cpp_compiler``)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return str(get_cpp_compiler())


def preload_export() -> None:
    """Import ``torch.export._trace``, which ``torch.export.export`` loads on its first call anyway."""
    with contextlib.suppress(ImportError):
        importlib.import_module("torch.export._trace")


def release_trace() -> None:
    """Drop the graph nodes of the last trace, which ``proxy_tensor`` keeps for the next export
    (``_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT``): after a compile that froze, they keep the graph
    module, and with it every folded weight, alive until the process ends. Without it, nothing is kept."""
    from torch.fx.experimental import proxy_tensor

    kept = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(kept, dict):
        kept.clear()


def use_header_store() -> None:
    """Keep Inductor's precompiled headers (``codecache._HEADER_DIR``) in one directory per torch
    install, removing those of installs that no longer exist: they are large and keyed by the
    install's path, and Inductor keeps them forever, so every isolated build would leave its own
    copy behind (sizes in docs/performance.md). Without ``_HEADER_DIR``, Inductor's own place is used."""
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
    """Keep the build's directories out of the compiled code (``-ffile-prefix-map``), wrapping
    ``cpp_builder._get_optimization_cflags`` and ``CppBuilder.get_command_line``: Inductor has no
    setting for extra compiler flags, and ``__FILE__`` paths would make two builds differ. The map
    of the Inductor cache goes only to commands that compile its sources, since in every command
    it would change the key of the precompiled headers. A torch without them builds as usual,
    correct but not free of paths."""
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
