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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

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


def before_compile() -> None:
    """What a build process sets up before any backend compiles in it."""
    use_header_store()
    keep_gelu_apart()


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
def distinct_constant_names() -> Iterator[None]:
    """Give each constant Inductor makes while it lowers a name of its own in the weights kept out of
    the library: oneDNN's int8 lowerings make one ``x_scale`` per quantized convolution, and the
    weights file, which Inductor keys by that name, would otherwise keep one of them for all.
    ``GraphLowering.allocate_non_dup_const_name`` records the name asked for as the original one."""
    from torch._inductor.graph import GraphLowering

    allocate = getattr(GraphLowering, "allocate_non_dup_const_name", None)
    if allocate is None:  # another torch: its names as they are
        yield
        return

    def allocating(self: Any, name: str | None, data: Any) -> str:
        known, taken = set(self.constants), set(self.allocated_constant_name.values())
        made = allocate(self, name, data)
        if made not in known and made != name and self.allocated_constant_name.get(made) in taken:
            self.allocated_constant_name[made] = made  # a new constant, not one it found again
        return made

    GraphLowering.allocate_non_dup_const_name = allocating  # type: ignore[method-assign]
    try:
        yield
    finally:
        GraphLowering.allocate_non_dup_const_name = allocate  # type: ignore[method-assign]


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


class Packing(NamedTuple):
    """One packed tensor Inductor folded: the dense tensor it ships as (the one it came from, or its
    transpose for an op that packs a weight into the transposed shape; None where it did not come from
    one alone), the op (None for ops that pack several at once) and the op's other arguments."""

    packed: Any
    dense: Any
    op: str | None
    args: list[Any] | None


class PackedWeights:
    """Weights Inductor packs for oneDNN while it freezes a model, shipped instead as the dense tensors
    they are packed from: oneDNN picks a packed layout for the CPU at hand, so the loader packs them
    again where the model runs (``replays``: each constant's packing op and its other arguments).
    ``ops``: the packing ops the loader runs (``loader.packing.OPS``), by name.
    """

    def __init__(self, ops: Mapping[str, Any]) -> None:
        self.ops = ops
        self.replays: dict[str, dict[str, Any]] = {}
        self.made: dict[int, Packing] = {}  # by id of the packed tensor

    def record(self, node: Any, args: tuple[Any, ...], out: Any) -> None:
        """What a folded node packed, if it packed anything, and from what."""
        import torch

        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if not outs or not all(isinstance(o, torch.Tensor) and o.is_mkldnn for o in outs):
            return
        op = getattr(getattr(node.target, "_overloadpacket", node.target), "_qualified_op_name", None)
        known = self.ops.get(str(op)) if len(outs) == 1 and args and isinstance(args[0], torch.Tensor) else None
        if known is not None and id(outs[0]) not in self.made:  # one weight, the op's other arguments
            dense = None if args[0].is_mkldnn else args[0].t() if known.transposed else args[0]
            self.made[id(outs[0])] = Packing(outs[0], dense, op, list(args[1:]))
            return
        leading = next((i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args))
        sources, rest = list(args[:leading]), list(args[leading:])
        one_each = len(sources) == len(outs) and not any(isinstance(a, torch.Tensor) for a in rest)
        for i, packed in enumerate(outs):
            if id(packed) in self.made:  # a ``getitem`` of an op's list keeps the op's record
                continue
            dense = sources[i] if one_each and not sources[i].is_mkldnn else None
            self.made[id(packed)] = Packing(packed, dense, op if len(outs) == 1 else None, rest)

    def unpack(self, gm: Any) -> None:
        """Each packed constant of ``gm`` replaced by the dense tensor it was packed from. A dense
        tensor that is also a constant of its own, or packed twice, is not packed again at load
        where the model runs without it: the library holds it once, for every use. Where it runs
        only packed (int8), each packed constant gets a copy of its own instead. A strided one
        (a transposed weight) that is not also a constant of its own ships contiguous, one copy per
        source; the model compiles with those copies beside the weights."""
        import torch

        named = {_place(v): n for n, _, _, v in _constants(gm) if v is not None and not getattr(v, "is_mkldnn", False)}
        plain = set(named)
        copies: dict[tuple[Any, ...], Any] = {}  # by place of a strided source: its one contiguous copy
        for name, holder, attr, value in _constants(gm):
            if not getattr(value, "is_mkldnn", False):
                continue
            found = self.made.get(id(value)) or Packing(None, None, None, None)
            dense = found.dense if found.packed is value else None
            known = self.ops.get(found.op or "")
            args = _json_args(found.args or [], named) if found.args is not None else None
            if (
                dense is None
                or dense.shape != value.shape
                or dense.dtype != value.dtype
                or (known is not None and known.required and args is None)
            ):
                raise RuntimeError(
                    f"Inductor packed weight {name} for oneDNN ({found.op or 'an unknown op'}) in a "
                    "way hatch-aoti cannot ship portably; set `cpp.weight_prepack = false` in the model's "
                    "inductor-configs"
                )
            place = _place(dense)
            required = known is not None and known.required
            if not dense.is_contiguous() and place not in plain:  # the library would copy it per call
                if place not in copies:
                    copies[place] = dense.contiguous()
                dense = copies[place]
                place = _place(dense)
            if required and place in plain:  # packed at load: a tensor of its own, which Inductor keeps apart
                dense = dense.clone(memory_format=torch.contiguous_format)
                place = _place(dense)
            setattr(holder, attr, dense)
            if known is not None and args is not None and (place not in plain or required):
                self.replays[name] = {"op": found.op, "args": args}
            plain.add(place)
        self.made.clear()  # the packed tensors, no longer in the graph

    def check(self) -> None:
        """Raise where Inductor packed weights and the pass that unpacks them never ran."""
        if self.made:
            raise RuntimeError(
                "Inductor packed weights for oneDNN, and this torch never ran the pass that ships them "
                "dense (`post_grad_custom_post_pass`); set `cpp.weight_prepack = false` in the model's "
                "inductor-configs"
            )


#: The oneDNN fusions :func:`keep_gelu_apart` kept Inductor from registering in this process.
GELU_KEPT_APART: list[str] = []


def keep_gelu_apart() -> None:
    """Keep Inductor from folding a GELU into the float32 oneDNN linear layer before it, as a post-op:
    on AVX2 CPUs that post-op slows the matrix product by about a third, far more than the GELU
    costs as Inductor's own kernel (docs/configuration.md#fast-defaults). Inductor registers these
    fusions once per process, at its first compile, so every compile calls this first; a torch
    without this registration step keeps its fusions."""
    try:
        from torch._inductor.fx_passes import mkldnn_fusion

        register = mkldnn_fusion._register_unary_fusion_lowering
        registered = mkldnn_fusion._mkldnn_fusion_init.cache_info().currsize
    except (ImportError, AttributeError):
        return
    if getattr(register, "keeps_gelu_apart", False) or registered:
        return
    import torch

    linear = torch.ops.mkldnn._linear_pointwise.default

    def registering(pattern: Any, unary_attr: Any, computation_op: Any, *rest: Any, **named: Any) -> Any:
        lowp_dtype = rest[0] if rest else named.get("lowp_dtype")
        if getattr(unary_attr, "op_name", None) == "gelu" and computation_op is linear and lowp_dtype is None:
            GELU_KEPT_APART.append(f"{computation_op} + gelu ({getattr(unary_attr, 'algorithm_attr', '?')})")
            return None
        return register(pattern, unary_attr, computation_op, *rest, **named)

    registering.keeps_gelu_apart = True  # type: ignore[attr-defined]
    mkldnn_fusion._register_unary_fusion_lowering = registering


def _place(tensor: Any) -> tuple[Any, ...]:
    """Where a dense tensor's values are: two views alike of one storage (a tied weight, or a linear
    weight seen through two transposes) are one constant to Inductor, which stores it once."""
    try:
        storage = tensor.untyped_storage().data_ptr()
        return storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype
    except (AttributeError, RuntimeError, NotImplementedError):  # a script object, a subclass: only itself
        return (id(tensor),)


def _constants(gm: Any) -> Iterator[tuple[str, Any, str, Any]]:
    """Each ``get_attr`` of ``gm``: its name, the module holding it, its name there, its value."""
    for node in gm.graph.find_nodes(op="get_attr"):
        owner, _, attr = node.target.rpartition(".")
        holder = gm.get_submodule(owner) if owner else gm
        yield node.target, holder, attr, getattr(holder, attr, None)


def _json_args(args: list[Any], named: dict[tuple[Any, ...], str]) -> list[Any] | None:
    """The arguments as JSON values (tuples as lists; a tensor as ``{"values": [...], "dtype": ...}`` where
    it is small, else ``{"constant": name}`` where it is one of ``named``), or None where one is not (a
    symbolic size, a tensor of no constant)."""
    out: list[Any] = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            inner = _json_args(list(arg), named)
            if inner is None:
                return None
            out.append(inner)
        elif arg is None or type(arg) in (bool, int, float, str):
            out.append(arg)
        elif _small(arg):  # Inductor writes those into its code
            out.append({"values": arg.reshape(-1).tolist(), "dtype": str(arg.dtype).removeprefix("torch.")})
        elif _place(arg) in named and len(_place(arg)) > 1:
            out.append({"constant": named[_place(arg)]})
        else:
            return None
    return out


def _small(arg: Any) -> bool:
    """A tensor the loader takes back by value (``loader.packing.BY_VALUE``, ``VALUE_DTYPES``)."""
    import torch

    from hatch_aoti.loader import packing

    return (
        isinstance(arg, torch.Tensor)
        and arg.dim() <= 1
        and arg.numel() <= packing.BY_VALUE
        and str(arg.dtype).removeprefix("torch.") in packing.VALUE_DTYPES
        and bool(torch.isfinite(arg).all())
    )


@contextlib.contextmanager
def packed_weights(ops: Mapping[str, Any]) -> Iterator[PackedWeights]:
    """Record the packings Inductor folds while it freezes (``constant_folding.ConstantFolder.run_node``)
    and set the pass that unpacks them (``config.post_grad_custom_post_pass``); a torch that packs
    elsewhere, or never runs the pass, fails the compile with a message (see :meth:`PackedWeights.check`)."""
    from torch._inductor import config
    from torch._inductor.constant_folding import ConstantFolder
    from torch._inductor.custom_graph_pass import CustomGraphPass

    packed = PackedWeights(ops)

    class Unpack(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            packed.unpack(graph.owning_module)

        def uuid(self) -> Any:
            return "hatch-aoti-unpack-3"

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
