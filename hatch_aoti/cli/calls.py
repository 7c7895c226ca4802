"""Inputs for a compiled model, made from its manifest entry alone (no factory, no samples).

The cases are those the build verified, at its sizes; :mod:`hatch_aoti.worker.generate` remakes
its generated inputs exactly (each case's seed, each leaf's value range), and makes the
rest where the build verified the project's own samples. A model built without
verification is tried at its example size and at both ends of each dynamic dim's range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hatch_aoti.loader.schema import Dim, Entry, Leaf, precision_of


@dataclass(frozen=True)
class Case:
    label: str
    sizes: dict[str, int]
    seed: int | None = None
    """The seed of the build's own inputs for this case; ``None``: generated here (seed 0)."""


def dims(entry: Entry) -> dict[str, tuple[int, int | None]]:
    """Each root dynamic dim's (min, max); max ``None`` when unbounded. A derived dim (``samples =
    320*frames``) follows its root, so its root is the one tried and set."""
    found: dict[str, tuple[int, int | None]] = {}
    for leaf in entry["call"]:
        for d in leaf.get("shape", []):
            if isinstance(d, dict):
                mult, offset = d.get("mult", 1), d.get("offset", 0)
                high = None if d["max"] is None else (d["max"] - offset) // mult
                found.setdefault(str(d.get("root", d["name"])), ((d["min"] - offset) // mult, high))
    return found


def _sizes_of(entry: Entry, shapes: list[list[int]]) -> dict[str, int] | None:
    """The root dims' sizes of one tried case, from its tensors' shapes; ``None`` where they do not fit."""
    tensors = [leaf for leaf in entry["call"] if "const" not in leaf]
    if len(shapes) != len(tensors) or any(len(s) != len(leaf["shape"]) for s, leaf in zip(shapes, tensors)):
        return None
    return {
        str(d.get("root", d["name"])): (n - d.get("offset", 0)) // d.get("mult", 1)
        for leaf, shape in zip(tensors, shapes)
        for d, n in zip(leaf["shape"], shape)
        if isinstance(d, dict)
    }


def _tried(entry: Entry) -> list[Case]:
    found, roots = [], set(dims(entry))
    for tried in entry.get("verification", {}).get("tried", []):
        sizes = _sizes_of(entry, tried.get("shapes", []))
        if sizes is not None and set(sizes) == roots:
            found.append(Case(tried["inputs"], sizes, tried.get("seed")))
    return found


def example_sizes(entry: Entry, tried: list[Case] | None = None) -> dict[str, int]:
    """The sizes the build verified as its first input set, where the report has them; else mid-range."""
    tried = _tried(entry) if tried is None else tried
    if tried:
        return tried[0].sizes
    return {name: lo if hi is None else (lo + hi) // 2 for name, (lo, hi) in dims(entry).items()}


def cases(entry: Entry, overrides: dict[str, int] | None = None) -> list[Case]:
    """The build's cases; without a verification report, the example and each dynamic dim at its
    min and max (the others at their example sizes). With ``overrides``, one case at those sizes."""
    tried = _tried(entry)
    if tried and not overrides:
        return tried
    example = {**example_sizes(entry, tried), **(overrides or {})}
    found = [Case("example", example)]
    if overrides:
        return found
    for name, (lo, hi) in dims(entry).items():
        for label, size in (("min", lo), ("max", hi)):
            if size is not None and size != example[name]:
                found.append(Case(f"{name}={size} ({label})", {**example, name: size}))
    return found


def parse_shape(texts: list[str], entry: Entry) -> dict[str, int]:
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


def in_spec(entry: Entry, model: Any) -> str:
    """The serialised structure of the model's inputs: the manifest's, or else its AOTInductor runner's."""
    if "call_spec" in entry:
        return entry["call_spec"][0]
    return model.runner.get_call_spec()[0]


def make_inputs(
    entry: Entry, sizes: dict[str, int], spec: str, seed: int | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) with the structure ``spec`` (see :func:`in_spec`), at ``sizes``: the build's own
    inputs where ``seed`` is the case's."""
    from torch.utils import _pytree as pytree

    from hatch_aoti.worker import generate

    gen = generate.generator(seed or 0)
    leaves = [
        leaf["const"]
        if "const" in leaf
        else generate.tensor(_shape(leaf, sizes), leaf["dtype"], leaf["device"], gen, leaf.get("low"), leaf.get("high"))
        for leaf in entry["call"]
    ]
    args, kwargs = pytree.tree_unflatten(leaves, pytree.treespec_loads(spec))
    return tuple(args), dict(kwargs)


def leaves_at(entry: Entry, sizes: dict[str, int]) -> list[Leaf]:
    """The manifest's input leaves with their dims' sizes filled in."""
    filled: list[Leaf] = []
    for leaf in entry["call"]:
        filled.append(leaf if "const" in leaf else {**leaf, "shape": list[int | Dim](_shape(leaf, sizes))})
    return filled


def _shape(leaf: Leaf, sizes: dict[str, int]) -> list[int]:
    return [d if isinstance(d, int) else _size(d, sizes) for d in leaf["shape"]]


def _size(dim: Dim, sizes: dict[str, int]) -> int:
    return dim.get("mult", 1) * sizes[dim.get("root", dim["name"])] + dim.get("offset", 0)


def describe(entry: Entry, sizes: dict[str, int] | None = None) -> str:
    """``float32[batch, 128], int64[2, 7]``: the tensor inputs, at ``sizes`` or with their dims' names."""
    parts = []
    for leaf in entry["call"]:
        if "const" not in leaf:
            shape = [
                str(d) if isinstance(d, int) else str(_size(d, sizes)) if sizes else d["name"] for d in leaf["shape"]
            ]
            parts.append(f"{leaf['dtype']}[{', '.join(shape)}]")
    return ", ".join(parts)


def run_case(entry: Entry, model: Any, module: Any, case: Case) -> dict[str, Any]:
    """One case: the compiled model on inputs made for it, and, given the eager module, both compared
    (outputs, and the inputs after the call: each runs on its own copy)."""
    import torch

    from hatch_aoti.worker.verify import compare, copied, reference

    result: dict[str, Any] = {
        "case": case.label,
        "inputs": describe(entry, case.sizes),
        "the_builds_inputs": case.seed is not None,
    }
    sample = make_inputs(entry, case.sizes, in_spec(entry, model), case.seed)
    pristine = copied(sample)  # for a float64 run, if the outputs are low-precision
    (args, kwargs), (e_args, e_kwargs) = sample, copied(sample)  # each run its own inputs: a model may write them
    with torch.no_grad():
        try:
            actual = model(*args, **kwargs)
            expected = module(*e_args, **e_kwargs) if module is not None else None
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {first_line(exc)}"
            return result
    report = entry.get("verification") or {}
    precision = precision_of(entry)
    if module is not None and precision != "float32":  # a lower-precision variant, checked as the build did
        from hatch_aoti.settings.constants import ACCURACY
        from hatch_aoti.worker.precision import limits_of, variant_problems

        worst = {"rel_error": 0.0, "cosine": 1.0}
        exact = reference(module, *pristine)
        written = ((e_args, e_kwargs), (args, kwargs))
        limit = limits_of(report) if "precision" in report else ACCURACY[precision]  # verify = false: defaults
        found = variant_problems(case.label, expected, actual, exact, written, limit, worst)
        result.update(worst)
        if found:
            result["error"] = f"the {precision} variant differs from float32 eager: " + "; ".join(found)
    elif module is not None:
        tolerances = report.get("rtol"), report.get("atol")
        # against a float64 run where eager alone cannot judge, as the build checked them
        comparison = compare(case.label, expected, actual, *tolerances, reference=lambda: reference(module, *pristine))
        inputs = compare(case.label, (e_args, e_kwargs), (args, kwargs), *tolerances, what="input")
        result.update(max_abs_err=comparison.max_abs, max_rel_err=comparison.max_rel)
        problems = comparison.problems + [f"after the call, {p}" for p in inputs.problems]
        if problems:
            result["error"] = "differs from eager: " + "; ".join(problems)
    return result


def run_cases(entry: Entry, model: Any, module: Any) -> tuple[list[dict[str, Any]], str]:
    """Every case of :func:`cases`, run by :func:`run_case`; and the first failure, as ``case: error``
    (``""`` when none failed)."""
    tried = [run_case(entry, model, module, case) for case in cases(entry)]
    bad = [c for c in tried if "error" in c]
    return tried, f"{bad[0]['case']}: {bad[0]['error']}" if bad else ""


def first_line(message: object) -> str:
    """An error's first line: each model's result is one line."""
    text = str(message).strip()
    return text.splitlines()[0] if text else ""
