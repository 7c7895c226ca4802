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


class PackedWeights:
    """Weights Inductor packs for oneDNN while it freezes a model, shipped instead as the dense tensors
    they are packed from: oneDNN picks a packed layout for the CPU at hand, so the loader packs them
    again where the model runs (``replays``: each constant's packing op and its other arguments).

    It records each packing that ``ConstantFolder.run_node`` folds, and ``graph_pass`` (a
    ``post_grad_custom_post_pass``) puts the dense tensor back in place of each packed constant.
    """

    def __init__(self, repacked: frozenset[str]) -> None:
        self.repacked = repacked
        self.replays: dict[str, dict[str, Any]] = {}
        self.made: dict[int, tuple[Any, Any, str | None, list[Any] | None]] = {}  # id(packed): packed, dense, op, args

    def record(self, node: Any, args: tuple[Any, ...], out: Any) -> None:
        import torch

        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if not outs or not all(isinstance(o, torch.Tensor) and o.is_mkldnn for o in outs):
            return
        op = getattr(getattr(node.target, "_overloadpacket", node.target), "_qualified_op_name", None)
        count = next((i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args))
        dense, rest = list(args[:count]), list(args[count:])
        plain = len(dense) == len(outs) and not any(isinstance(a, torch.Tensor) for a in rest)
        for i, packed in enumerate(outs):  # an op's list of packed tensors: each from its own dense one
            if id(packed) not in self.made:  # a ``getitem`` of the list keeps the op's record
                one = plain and len(outs) == 1
                self.made[id(packed)] = (packed, dense[i] if plain else None, op if one else None, _json_args(rest))

    def unpack(self, gm: Any) -> None:
        """Each packed constant of ``gm`` replaced by the dense tensor it was packed from."""
        for node in gm.graph.find_nodes(op="get_attr"):
            owner, _, attr = node.target.rpartition(".")
            holder = gm.get_submodule(owner) if owner else gm
            value = getattr(holder, attr, None)
            if not getattr(value, "is_mkldnn", False):
                continue
            packed, dense, op, args = self.made.get(id(value), (None, None, None, None))
            if packed is not value or dense is None or dense.shape != value.shape or dense.dtype != value.dtype:
                raise RuntimeError(
                    f"Inductor packed weight {node.target} for oneDNN ({op or 'an unknown op'}) in a way "
                    "hatch-aoti cannot ship portably; set `cpp.weight_prepack = false` in the model's "
                    "inductor-configs"
                )
            setattr(holder, attr, dense)
            if op in self.repacked and args is not None:
                self.replays[node.target] = {"op": op, "args": args}
        self.made.clear()  # the packed tensors, no longer in the graph


def _json_args(args: list[Any]) -> list[Any] | None:
    """The arguments as JSON values (tuples as lists), or None where one is not (a symbolic size)."""
    out: list[Any] = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            inner = _json_args(list(arg))
            if inner is None:
                return None
            out.append(inner)
        elif arg is None or type(arg) in (bool, int, float, str):
            out.append(arg)
        else:
            return None
    return out


@contextlib.contextmanager
def packed_weights(repacked: frozenset[str]) -> Iterator[PackedWeights]:
    """Record the packings Inductor folds while frozen (``constant_folding.ConstantFolder.run_node``)
    and set the pass that unpacks them (``config.post_grad_custom_post_pass``). A torch without the
    folder fails its first packed model with the message of :meth:`PackedWeights.unpack`."""
    from torch._inductor import config
    from torch._inductor.constant_folding import ConstantFolder
    from torch._inductor.custom_graph_pass import CustomGraphPass

    packed = PackedWeights(repacked)

    class Unpack(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            packed.unpack(graph.owning_module)

        def uuid(self) -> Any:
            return "hatch-aoti-unpack-1"

    run_node = ConstantFolder.run_node

    def recording(self: Any, node: Any) -> Any:
        out = run_node(self, node)
        if node.op == "call_function":
            with contextlib.suppress(Exception):  # arguments the folder could not compute
                packed.record(node, self.fetch_args_kwargs_from_env(node)[0], out)
        return out

    ConstantFolder.run_node = recording  # type: ignore[method-assign]
    try:
        with config.patch(post_grad_custom_post_pass=Unpack()):
            yield packed
    finally:
        ConstantFolder.run_node = run_node  # type: ignore[method-assign]
