"""Inputs for a compiled model, made from its manifest entry alone (no factory, no samples).

Each named dynamic dim is tried at its example size and at both ends of its range. Values
are random normals for floating dtypes and 0/1 for integers and bools, which any
embedding or index input accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Case:
    label: str
    sizes: dict[str, int]


def dims(entry: dict[str, Any]) -> dict[str, tuple[int, int | None]]:
    """Each root dynamic dim's (min, max); max ``None`` when unbounded. A derived dim (``samples =
    320*frames``) follows its root, so its root is the one tried and set."""
    found: dict[str, tuple[int, int | None]] = {}
    for leaf in entry["call"]:
        for d in leaf.get("shape", []):
            if isinstance(d, dict):
                mult, offset = d.get("mult", 1), d.get("offset", 0)
                high = None if d["max"] is None else (d["max"] - offset) // mult
                found.setdefault(d.get("root", d["name"]), ((d["min"] - offset) // mult, high))
    return found


def example_sizes(entry: dict[str, Any]) -> dict[str, int]:
    """The sizes the build verified as its example, where the report has them; else mid-range."""
    sizes = {name: lo if hi is None else (lo + hi) // 2 for name, (lo, hi) in dims(entry).items()}
    tried = [t for t in entry.get("verification", {}).get("tried", []) if t.get("inputs") == "example"]
    tensors = [leaf for leaf in entry["call"] if "const" not in leaf]
    if tried and len(tried[0]["shapes"]) == len(tensors):
        for leaf, shape in zip(tensors, tried[0]["shapes"]):
            if len(shape) == len(leaf["shape"]):
                sizes.update({d.get("root", d["name"]): (n - d.get("offset", 0)) // d.get("mult", 1)
                              for d, n in zip(leaf["shape"], shape) if isinstance(d, dict)})  # fmt: skip
    return sizes


def cases(entry: dict[str, Any], overrides: dict[str, int] | None = None) -> list[Case]:
    """The example, then each dynamic dim at its min and max (the others at their example sizes)."""
    example = {**example_sizes(entry), **(overrides or {})}
    found = [Case("example", example)]
    if overrides:
        return found
    for name, (lo, hi) in dims(entry).items():
        for label, size in (("min", lo), ("max", hi)):
            if size is not None and size != example[name]:
                found.append(Case(f"{name}={size} ({label})", {**example, name: size}))
    return found


def parse_shape(texts: list[str], entry: dict[str, Any]) -> dict[str, int]:
    """``--shape batch=8`` options as sizes; a ValueError names the unknown dim or the range."""
    known, sizes = dims(entry), {}
    for text in texts:
        name, _, value = text.partition("=")
        if name not in known:
            raise ValueError(f"--shape {text}: no dynamic dim {name!r}; the model's: {', '.join(known) or 'none'}")
        lo, hi = known[name]
        if not value.isdigit() or int(value) < lo or (hi is not None and int(value) > hi):
            raise ValueError(f"--shape {text}: {name} must be an integer in [{lo}, {hi if hi is not None else 'inf'}]")
        sizes[name] = int(value)
    return sizes


def in_spec(entry: dict[str, Any], model: Any) -> str:
    """The serialised structure of the model's inputs: the manifest's, or else its AOTInductor runner's."""
    if "call_spec" in entry:
        return entry["call_spec"][0]
    return model.runner.get_call_spec()[0]


def make_inputs(entry: dict[str, Any], sizes: dict[str, int], spec: str, seed: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) with the structure ``spec`` (see :func:`in_spec`), at ``sizes``."""
    import torch
    from torch.utils import _pytree as pytree

    generator = torch.Generator().manual_seed(seed)
    leaves = [_leaf(torch, leaf, sizes, generator) for leaf in entry["call"]]
    args, kwargs = pytree.tree_unflatten(leaves, pytree.treespec_loads(spec))
    return tuple(args), dict(kwargs)


def leaves_at(entry: dict[str, Any], sizes: dict[str, int]) -> list[dict[str, Any]]:
    """The manifest's input leaves with their dims' sizes filled in."""
    return [leaf if "const" in leaf else {**leaf, "shape": _shape(leaf, sizes)} for leaf in entry["call"]]


def _shape(leaf: dict[str, Any], sizes: dict[str, int]) -> list[int]:
    return [d if isinstance(d, int) else _size(d, sizes) for d in leaf["shape"]]


def _size(dim: dict[str, Any], sizes: dict[str, int]) -> int:
    return dim.get("mult", 1) * sizes[dim.get("root", dim["name"])] + dim.get("offset", 0)


def _leaf(torch: Any, leaf: dict[str, Any], sizes: dict[str, int], generator: Any) -> Any:
    if "const" in leaf:
        return leaf["const"]
    shape = _shape(leaf, sizes)
    dtype = getattr(torch, leaf["dtype"])
    if dtype.is_floating_point or dtype.is_complex:
        value = torch.randn(shape, generator=generator).to(dtype)
    else:
        value = torch.randint(0, 2, shape, generator=generator).to(dtype)
    return value.to(leaf["device"])


def describe(entry: dict[str, Any], sizes: dict[str, int] | None = None) -> str:
    """``float32[batch, 128], int64[2, 7]``: the tensor inputs, at ``sizes`` or with their dims' names."""
    parts = []
    for leaf in entry["call"]:
        if "const" not in leaf:
            shape = [str(d) if isinstance(d, int) else str(_size(d, sizes)) if sizes else d["name"]
                     for d in leaf["shape"]]  # fmt: skip
            parts.append(f"{leaf['dtype']}[{', '.join(shape)}]")
    return ", ".join(parts)


def run_case(entry: dict[str, Any], model: Any, module: Any, case: Case) -> dict[str, Any]:
    """One case: the compiled model on inputs made for it, and, given the eager module, both compared
    (outputs, and the inputs after the call: each runs on its own copy)."""
    import torch

    from hatch_aoti.verify import compare, copied

    result: dict[str, Any] = {"case": case.label, "inputs": describe(entry, case.sizes)}
    sample = make_inputs(entry, case.sizes, in_spec(entry, model))
    (args, kwargs), (e_args, e_kwargs) = sample, copied(sample)  # each run its own inputs: a model may write them
    with torch.no_grad():
        try:
            actual = model(*args, **kwargs)
            expected = module(*e_args, **e_kwargs) if module is not None else None
        except Exception as exc:  # noqa: BLE001 - reported per case
            result["error"] = f"{type(exc).__name__}: {first_line(exc)}"
            return result
    if module is not None:
        report = entry.get("verification") or {}
        tolerances = report.get("rtol"), report.get("atol")
        comparison = compare(case.label, expected, actual, *tolerances)
        inputs = compare(case.label, (e_args, e_kwargs), (args, kwargs), *tolerances, what="input")
        result.update(max_abs_err=comparison.max_abs, max_rel_err=comparison.max_rel)
        problems = comparison.problems + [f"after the call, {p}" for p in inputs.problems]
        if problems:
            result["error"] = "differs from eager: " + "; ".join(problems)
    return result


def first_line(message: object) -> str:
    """An error's first line: each model's result is one line."""
    text = str(message).strip()
    return text.splitlines()[0] if text else ""
