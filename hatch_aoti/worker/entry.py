"""A model's manifest entry, as its exported program and input plan give it: the call the loader checks,
the outputs it rebuilds, the dims ``info()`` shows, the modules of its containers and the files it ships.

Runs inside the worker (it imports torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils import _pytree as pytree

from hatch_aoti.backends.interface import InputPlan
from hatch_aoti.loader.schema import Dim, Leaf, Output
from hatch_aoti.worker.inputs import rule_text


def describe_call(exported: Any, plan: InputPlan, mutated: frozenset[str] = frozenset()) -> list[Leaf]:
    """What each flattened input must be, as the exported program has it.

    The loader checks calls against this (AOTInductor itself does not): dtype, device,
    rank, static sizes, each dynamic size's range and rule (``samples = 320*frames``);
    constants that export baked in must be passed unchanged. ``mutated`` names (by
    pytree key path) the inputs the eager model writes into.
    """
    from torch.export.graph_signature import ConstantArgument, InputKind, TensorArgument

    nodes = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    rows = index_rows(exported)
    paths = [
        pytree.keystr(p)
        for p, _ in pytree.tree_flatten_with_path(
            pytree.tree_unflatten([0] * exported.call_spec.in_spec.num_leaves, exported.call_spec.in_spec)
        )[0]
    ]
    user = [s.arg for s in exported.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    tensors = [nodes[arg.name].meta["val"] for arg in user if isinstance(arg, TensorArgument)]
    names = symbol_names(tensors, plan)
    out: list[Leaf] = []
    for path, arg in zip(paths, user):
        if isinstance(arg, ConstantArgument):
            value = arg.value
            plain = value is None or isinstance(value, (bool, int, float, str))
            out.append({"const": value if plain else repr(value), "check_const": plain})
            continue
        if not isinstance(arg, TensorArgument):
            out.append({"const": repr(arg), "check_const": False})
            continue
        position = len([leaf for leaf in out if "const" not in leaf])
        axis_names = plan.axis_names[position] if position < len(plan.axis_names) else {}
        fake = nodes[arg.name].meta["val"]
        shape = [
            size if isinstance(size, int) else _dynamic_axis(exported, size.node.expr, names, axis_names.get(axis))
            for axis, size in enumerate(fake.shape)
        ]
        leaf: Leaf = {"dtype": str(fake.dtype).removeprefix("torch."), "device": fake.device.type, "shape": shape}
        low, high = plan.values[position] if position < len(plan.values) else (None, None)
        if low is not None:
            leaf["low"] = low
        if high is not None:
            leaf["high"] = high
        if arg.name in rows and fake.device.type == "cpu":  # on CUDA the check would wait for the GPU
            leaf["index_rows"] = rows[arg.name]
        out.append({**leaf, "mutated": True} if path in mutated else leaf)
    return out


#: Ops that pass their input's values on unchanged, between an input and the lookup it indexes.
_SAME_VALUES = {"view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze", "contiguous", "clone", "alias"}


def index_rows(exported: Any) -> dict[str, int]:
    """Integer inputs the model uses as row indices of a table (``embedding``, ``index_select`` on dim 0),
    by placeholder name: the rows of the smallest such table. An index outside it makes the compiled
    kernel's bounds check throw inside a parallel region, which ends the process; eager raises an
    IndexError, and so does the loader, which checks these inputs first."""
    import torch

    lookups = {torch.ops.aten.embedding.default: (0, 1), torch.ops.aten.index_select.default: (0, 2)}
    rows: dict[str, int] = {}
    for node in exported.graph.nodes:
        val = node.meta.get("val")  # a placeholder may be a str, a number or None (export keeps such inputs)
        if node.op != "placeholder" or not isinstance(val, torch.Tensor) or not str(val.dtype).startswith("torch.int"):
            continue
        reached, seen = [node], set()
        while reached:
            current = reached.pop()
            seen.add(current)
            for user in current.users:
                if user in seen or user.op != "call_function":
                    continue
                name = _packet(user.target)
                plain = getattr(user.target, "_overloadname", "") == "default"  # not view.dtype
                if name in _SAME_VALUES and plain and user.args and user.args[0] is current:
                    reached.append(user)
                elif user.target in lookups:
                    table, index = lookups[user.target]
                    size = _table_rows(user, table, index, current)
                    if size is not None:
                        rows[node.name] = min(rows.get(node.name, size), size)
    return rows


def _table_rows(lookup: Any, table: int, index: int, indices: Any) -> int | None:
    """The static row count of ``lookup``'s table, where ``indices`` is its index argument."""
    args = list(lookup.args)
    if len(args) <= index or args[index] is not indices:
        return None
    if lookup.target.__name__.startswith("index_select") and args[1] != 0:
        return None
    size = getattr(args[table], "meta", {}).get("val")
    shape = getattr(size, "shape", ())
    return shape[0] if shape and isinstance(shape[0], int) else None


def symbol_names(tensors: list[Any], plan: InputPlan) -> dict[Any, str]:
    """The dim name of each size symbol: as the plan names the axes that are the symbol itself, and
    as its rules name the roots of derived axes (``_samples`` in ``samples = 320*_samples``)."""
    names: dict[Any, str] = {}
    derived: list[tuple[Any, str]] = []
    for position, fake in enumerate(tensors):
        axis_names = plan.axis_names[position] if position < len(plan.axis_names) else {}
        for axis, size in enumerate(fake.shape):
            if isinstance(size, int):
                continue
            expr, name = size.node.expr, axis_names.get(axis)
            if expr.is_Symbol:
                names.setdefault(expr, name or str(expr))
            elif len(expr.free_symbols) == 1:
                derived.append((next(iter(expr.free_symbols)), name or ""))
    for symbol, name in derived:
        root = plan.rules.get(name, (None,))[0]
        names.setdefault(symbol, root or str(symbol))
    return names


def _dynamic_axis(exported: Any, expr: Any, names: dict[Any, str], axis_name: str | None) -> Dim:
    """One dynamic axis: its name and range, and for a derived one (``320*s0``) its root, multiple and offset."""
    if expr.is_Symbol:
        low, high = _bounds(exported, expr)
        return {"name": names.get(expr, str(expr)), "min": low, "max": high}
    if len(expr.free_symbols) != 1:
        raise ValueError(f"a dynamic size is {expr}, which is not of the form a*dim + b")
    (symbol,) = expr.free_symbols
    mult, offset = expr.coeff(symbol), expr.subs(symbol, 0)
    if not (mult.is_Integer and offset.is_Integer and mult > 0 and (mult * symbol + offset - expr).expand() == 0):
        raise ValueError(f"a dynamic size is {expr}, which is not of the form a*dim + b")
    low, high = _bounds(exported, symbol)
    root = names.get(symbol, str(symbol))
    name = axis_name or f"{int(mult)}*{root}" + (f"{int(offset):+d}" if offset else "")
    return {
        "name": name,
        "min": int(mult) * low + int(offset),
        "max": None if high is None else int(mult) * high + int(offset),
        "root": root,
        "mult": int(mult),
        "offset": int(offset),
    }


def _bounds(exported: Any, symbol: Any) -> tuple[int, int | None]:
    bounds = exported.range_constraints.get(symbol)
    low = _finite(bounds.lower) if bounds is not None else None
    return low or 0, _finite(bounds.upper) if bounds is not None else None


def describe_outputs(exported: Any) -> list[Output]:
    """What kind each flattened output is: the runner returns a 0-d tensor where eager returns a
    Python number, so the loader converts those back; constants are returned as they were."""
    from torch.export.graph_signature import (
        ConstantArgument,
        OutputKind,
        SymBoolArgument,
        SymFloatArgument,
        SymIntArgument,
    )

    kinds = {SymIntArgument: "int", SymFloatArgument: "float", SymBoolArgument: "bool"}
    viewed = views_of_inputs(exported)
    out: list[Output] = []
    for spec in exported.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            continue
        if isinstance(spec.arg, ConstantArgument) and isinstance(spec.arg.value, (bool, int, float, str, type(None))):
            out.append({"kind": "const", "value": spec.arg.value})
        else:
            kind: Output = {"kind": kinds.get(type(spec.arg), "tensor")}
            name = getattr(spec.arg, "name", None)
            if name in viewed:
                kind["view_of"] = viewed[name]
            out.append(kind)
    return out


#: Ops whose result is a view of their first argument whatever its strides (``view`` and ``reshape``
#: are not: on a strided tensor eager's ``reshape`` copies).
_ALWAYS_VIEWS = {"alias", "detach", "diagonal", "expand", "movedim", "narrow", "permute", "select", "slice"}
_ALWAYS_VIEWS |= {"squeeze", "swapaxes", "t", "transpose", "unfold", "unsqueeze"}


def views_of_inputs(exported: Any) -> dict[str, int]:
    """Nodes that eager computes as a view of a tensor input, by name: that input's position among the
    tensor inputs. The loader remakes those outputs on the caller's tensor where it ran a copy of it."""
    from torch.export.graph_signature import InputKind, TensorArgument

    specs = exported.graph_signature.input_specs
    user = [s.arg.name for s in specs if s.kind == InputKind.USER_INPUT and isinstance(s.arg, TensorArgument)]
    positions = {name: i for i, name in enumerate(user)}
    found: dict[str, int] = {}
    for node in exported.graph.nodes:
        base = node
        while getattr(base, "op", None) == "call_function" and base.args and _packet(base.target) in _ALWAYS_VIEWS:
            base = base.args[0]
        if getattr(base, "op", None) == "placeholder" and base.name in positions:
            found[node.name] = positions[base.name]
    return found


def _packet(target: Any) -> str:
    """An ATen op's name without its overload (``slice`` for ``aten.slice.Tensor``)."""
    return getattr(getattr(target, "_overloadpacket", None), "__name__", "")


def _finite(value: Any) -> int | None:
    """An int for a finite sympy bound, ``None`` for torch's (or sympy's) infinities."""
    try:
        return int(value)
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None


def call_spec(exported: Any) -> list[str]:
    """The exported program's input and output tree specs, serialised, for loaders that have no runner to ask."""
    return [pytree.treespec_dumps(exported.call_spec.in_spec), pytree.treespec_dumps(exported.call_spec.out_spec)]


def dynamic_info(plan: InputPlan) -> dict[str, dict[str, Any]]:
    """``info()["dynamic"]``: each dim's range, and a derived one's rule (``"rule": "320*frames"``)."""
    out: dict[str, dict[str, Any]] = {name: {"min": lo, "max": hi} for name, (lo, hi) in plan.dims.items()}
    for name, rule in plan.rules.items():
        out[name]["rule"] = rule_text(*rule)
    return out


def container_modules(exported: Any, *, named_only: bool = False) -> list[str]:
    """Modules that define the containers of a program's inputs and outputs (transformers'
    ``ModelOutput`` classes, say): a helper's ``torch.export.load`` needs them registered first,
    and a factory may import them only when it is called. ``named_only`` leaves out named
    tuples, which torch rebuilds from their fields alone."""
    found: list[str] = []
    specs = [exported.call_spec.in_spec, exported.call_spec.out_spec]
    while specs:
        spec = specs.pop()
        if spec is None:
            continue
        module = getattr(spec.type, "__module__", "builtins")
        named_tuple = isinstance(spec.type, type) and issubclass(spec.type, tuple) and hasattr(spec.type, "_fields")
        if module not in ("builtins", "collections", *found) and not (named_only and named_tuple):
            found.append(module)
        specs.extend(spec.children() if hasattr(spec, "children") else spec.children_specs)
    return found


def shipped_files(directory: Path, entry: dict[str, Any]) -> dict[str, str]:
    """sha256 of each of a model's files, reusing the digests its backend already made."""
    from hatch_aoti.pipeline.artifacts import file_hashes

    weights = entry.get("weights", {})
    known = {entry.get("file"): entry.get("sha256"), weights.get("file"): weights.get("sha256")}
    return file_hashes(directory, {k: v for k, v in known.items() if k and v})
