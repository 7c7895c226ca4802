"""What each input of a call must be, as the manifest records it: checks, descriptions for errors,
calls laid out as the model was exported, and the inputs a model writes into."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .schema import Dim, Leaf, Parameter


def tensor_check(torch: Any, leaf: Leaf) -> tuple[Any, ...]:
    """(dtype, on cpu?, static sizes (None where dynamic), ((axis, min, max, root, multiple, offset), ...))."""
    sizes = tuple(d if isinstance(d, int) else None for d in leaf["shape"])
    dims = tuple(
        (
            axis,
            d["min"],
            d["max"] if d["max"] is not None else float("inf"),
            d.get("root", d["name"]),
            d.get("mult", 1),
            d.get("offset", 0),
        )
        for axis, d in enumerate(leaf["shape"])
        if not isinstance(d, int)
    )
    if not dims:
        sizes = torch.Size(sizes)
    return getattr(torch, leaf["dtype"]), leaf["device"] == "cpu", sizes, dims


def fits(shape: Any, sizes: Any, dims: Any, roots: dict[str, int]) -> bool:
    """Rank, static sizes, dynamic ranges and rules of a shape; ``roots`` collects each root dim's value."""
    if len(shape) != len(sizes):
        return False
    for axis, size in enumerate(sizes):
        if size is not None and shape[axis] != size:
            return False
    for axis, low, high, root, mult, offset in dims:
        n = shape[axis]
        if not low <= n <= high or (n - offset) % mult:
            return False
        if roots.setdefault(root, (n - offset) // mult) != (n - offset) // mult:
            return False
    return True


def describe(leaf: Leaf) -> str:
    dims = []
    for d in leaf["shape"]:
        if isinstance(d, int):
            dims.append(str(d))
            continue
        text = f"{d['name']} in [{d['min']}, {d['max'] if d['max'] is not None else 'inf'}]"
        if d.get("mult", 1) != 1 or d.get("offset", 0):
            text += f" with {d['name']} = {rule(d)}"
        dims.append(text)
    return f"{leaf['dtype']} on {leaf['device']} with shape [{', '.join(dims)}]"


def rule(dim: Dim) -> str:
    """``320*frames``, ``2*n + 1``: a derived dim as its root, multiple and offset."""
    text = f"{dim['mult']}*{dim['root']}" if dim.get("mult", 1) != 1 else dim["root"]
    offset = dim.get("offset", 0)
    return f"{text} + {offset}" if offset > 0 else f"{text} - {-offset}" if offset < 0 else text


_OPAQUE = object()  # the default of a parameter whose default the manifest does not hold


def exported_layout(
    signature: list[Parameter], n_args: int, kwarg_names: tuple[str, ...], args: Any, kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call as ``forward`` takes it (arguments by name, defaults left out), laid out as the model was
    exported: its first ``n_args`` positional inputs, then ``kwarg_names``. A call ``forward`` would not
    take, or one that gives a value to an argument the export left at its default, comes back as it was
    (the caller's error is then raised)."""
    import inspect

    kinds = inspect.Parameter
    params = _parameters(signature)
    try:
        bound = inspect.Signature(params).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    bound.apply_defaults()
    values = bound.arguments
    positional: list[tuple[str | None, Any]] = []
    named: dict[str, Any] = {}
    for p in params:
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD):
            positional.append((p.name, values[p.name]))
        elif p.kind is kinds.VAR_POSITIONAL:
            positional.extend((None, v) for v in values[p.name])
        elif p.kind is kinds.KEYWORD_ONLY:
            named[p.name] = values[p.name]
        else:
            named.update(values[p.name])
    if any(n is None for n, _ in positional[n_args:]):
        return args, kwargs  # more positional inputs than the export had
    named.update((n, v) for n, v in positional[n_args:] if n is not None)
    layout = tuple(v for _, v in positional[:n_args]), {k: named.pop(k) for k in kwarg_names if k in named}
    defaults = {p.name: p.default for p in params}
    for key, value in named.items():  # left out of the export: only their defaults can reach the model
        default = defaults.get(key, kinds.empty)
        if value is _OPAQUE or not (value is default or (type(value) is type(default) and value == default)):
            return args, kwargs
    if any(v is _OPAQUE for v in (*layout[0], *layout[1].values())):
        return args, kwargs
    return layout


def _parameters(signature: list[Parameter]) -> list[Any]:
    """``forward``'s parameters from the manifest's record of them."""
    import inspect

    def default(p: Parameter) -> Any:
        return _OPAQUE if p.get("opaque_default") else p.get("default", inspect.Parameter.empty)

    return [inspect.Parameter(p["name"], getattr(inspect.Parameter, p["kind"]), default=default(p)) for p in signature]


def unsafe_writes(torch: Any, mutated: list[int]) -> Callable[[list[Any]], tuple[type[Exception], str] | None]:
    """A check of the inputs a model writes into: what eager would refuse (a leaf that requires grad,
    an inference tensor outside inference mode), or another input sharing a byte with it; the error
    to raise and its message, or None if the call is fine."""
    grad_on, inference_on = torch.is_grad_enabled, torch.is_inference_mode_enabled
    wheres = {position: f"input {position}, which the model writes into," for position in mutated}

    def unsafe(tensors: list[Any]) -> tuple[type[Exception], str] | None:
        for position, where in wheres.items():
            t = tensors[position]
            if t.requires_grad and t.is_leaf and grad_on():
                return (
                    RuntimeError,
                    f"{where} is a leaf tensor that requires grad, which eager cannot write into either",
                )
            if t.is_inference() and not inference_on():
                return (
                    RuntimeError,
                    f"{where} is an inference tensor, which eager writes into only under inference mode",
                )
            if len(tensors) == 1:
                continue
            memory = t.untyped_storage().data_ptr()
            for other, u in enumerate(tensors):
                if other != position and u.untyped_storage().data_ptr() == memory and _share_bytes(torch, t, u):
                    return ValueError, (
                        f"{where} shares memory with input {other}; the compiled model reads each input as it "
                        "was before the call, where eager would see the write: pass a copy (`.clone()`)"
                    )
        return None

    return unsafe


def _share_bytes(torch: Any, t: Any, u: Any) -> bool:
    """Whether two views of one storage hold a byte in common: by their spans, and where a span has
    gaps (a column, every other element), by the bytes themselves."""
    if not t.numel() or not u.numel():
        return False
    (a, b), (c, d) = _span(t), _span(u)
    if not (a < d and c < b):
        return False
    if (b - a == t.numel() * t.element_size()) and (d - c == u.numel() * u.element_size()):
        return True  # both dense in their spans
    return bool(torch.isin(_bytes(torch, t), _bytes(torch, u)).any())


def _span(t: Any) -> tuple[int, int]:
    start = t.storage_offset() * t.element_size()
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _bytes(torch: Any, t: Any) -> Any:
    """Every storage byte ``t`` covers."""
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n) * stride
    starts = (offsets.reshape(-1) + t.storage_offset()) * t.element_size()
    return (starts.unsqueeze(-1) + torch.arange(t.element_size())).reshape(-1)


def write_back(tensors: list[Any], copies: list[Any], mutated: list[int]) -> None:
    """The inputs the model writes into, written from the copies the compiled code ran on."""
    for position in mutated:
        if copies[position] is not tensors[position]:
            tensors[position].copy_(copies[position])


def contiguous(tensors: list[Any]) -> list[Any]:
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


def resolved(tensors: list[Any]) -> list[Any]:
    return [t.resolve_conj().resolve_neg().contiguous() if t.is_complex() else t for t in contiguous(tensors)]
