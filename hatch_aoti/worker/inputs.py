"""Example inputs and dynamic shapes: from TOML declarations or from user code.

Runs inside the worker (it imports torch). A *sample* is always normalised to
``(args: tuple, kwargs: dict)`` so export, verification and inference share one shape.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hatch_aoti.backends.interface import InputPlan, Sample
from hatch_aoti.settings.constants import parse_rule
from hatch_aoti.settings.model import DimSpec, TensorSpec
from hatch_aoti.settings.spec import ModelSpec
from hatch_aoti.worker import generate


class InputError(Exception):
    """An input problem, reported against a TOML key of the model."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing compiled with eager outputs of one dtype."""
    if dtype in (torch.float16,):
        return 1e-3, 1e-3
    if dtype in (torch.bfloat16,):
        return 1.6e-2, 1e-2
    if dtype in (torch.float64, torch.complex128):
        return 1e-7, 1e-7
    if dtype.is_floating_point or dtype.is_complex:
        return 1e-4, 1e-5
    return 0.0, 0.0


def _example_size(bounds: DimSpec) -> int:
    """A size inside the bounds that torch.export will not specialise (it does for 0 and 1)."""
    size = max(bounds.min if bounds.min is not None else 0, 2)
    if bounds.max is not None:
        size = min(size, bounds.max)
    return size


def _make_tensor(spec: TensorSpec, sizes: dict[str, int], device: str, gen: torch.Generator) -> torch.Tensor:
    shape = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
    return generate.tensor(shape, spec.dtype, spec.device or device, gen, spec.low, spec.high)


Rules = dict[str, tuple[str, int, int]]


def _rules(model: ModelSpec) -> Rules:
    """The model's derived dims, ``samples = "320*frames"``, as (root, multiple, offset); config checked them."""
    return {
        name: parsed
        for name, rule in model.dynamic.items()
        if isinstance(rule, str) and (parsed := parse_rule(rule)) is not None
    }


def _declared_dims(model: ModelSpec, rules: Rules) -> dict[str, DimSpec]:
    """The root dims (those without a rule) of the declared shapes, and the roots the rules name."""
    names: list[str] = []
    for spec in (*(model.inputs or ()), *model.kwargs.values()):
        names += [d for d in spec.shape if isinstance(d, str) and d not in names and d not in rules]
    names += [root for root, _, _ in rules.values() if root not in names]
    return {n: _bounds_of(model, n) for n in names}


def _bounds_of(model: ModelSpec, name: str) -> DimSpec:
    bounds = model.dynamic.get(name)
    return bounds if isinstance(bounds, DimSpec) else DimSpec()


def _derive(sizes: dict[str, int], rules: Rules) -> dict[str, int]:
    """Root sizes and, from them, each derived dim's."""
    return {**sizes, **{name: mult * sizes[root] + offset for name, (root, mult, offset) in rules.items()}}


def _derived_ranges(dims: dict[str, tuple[int, int | None]], rules: Rules) -> dict[str, tuple[int, int | None]]:
    """Each dim's (min, max), derived ones included."""
    out = dict(dims)
    for name, (root, mult, offset) in rules.items():
        low, high = dims[root]
        out[name] = (mult * low + offset, None if high is None else mult * high + offset)
    return out


def rule_text(root: str, mult: int, offset: int) -> str:
    """``320*frames``, ``2*n + 1``: the rule as ``dynamic`` spells it."""
    text = root if mult == 1 else f"{mult}*{root}"
    return f"{text} + {offset}" if offset > 0 else f"{text} - {-offset}" if offset < 0 else text


def torch_dims(roots: Mapping[str, tuple[int | None, int | None]], rules: Rules) -> dict[str, Any]:
    """``torch.export.Dim`` of every dim: roots with their bounds, derived ones from their roots."""
    made: dict[str, Any] = {
        n: torch.export.Dim(n, **{k: v for k, v in (("min", lo), ("max", hi)) if v is not None})
        for n, (lo, hi) in roots.items()
    }
    for name, (root, mult, offset) in rules.items():
        made[name] = made[root] if (mult, offset) == (1, 0) else made[root] * mult + offset
    return made


def _verify_sizes(dims: dict[str, DimSpec], example: dict[str, int]) -> list[tuple[str, dict[str, int]]]:
    """Example sizes, then every dim at its min, at a middle value and at its max."""
    out = [("example", example)]
    if not dims:
        return out
    lows = {n: (b.min if b.min is not None else 2) for n, b in dims.items()}
    highs = {n: (b.max if b.max is not None else 2 * example[n] + 1) for n, b in dims.items()}
    mids = {n: (lows[n] + highs[n]) // 2 for n in dims}
    for label, sizes in (("min", lows), ("mid", mids), ("max", highs)):
        if all(sizes != seen for _, seen in out):
            out.append((label, sizes))
    return out


def _describe(tensor_spec: TensorSpec) -> dict[str, Any]:
    return {"shape": list(tensor_spec.shape), "dtype": tensor_spec.dtype}


def plan_declared(model: ModelSpec, param_names: list[str], seed: int = 0) -> InputPlan:
    """Build samples and dims from ``inputs``/``kwargs``/``dynamic`` in TOML."""
    rules = _rules(model)
    dims = _declared_dims(model, rules)
    made = torch_dims({n: (b.min, b.max) for n, b in dims.items()}, rules)
    example = {n: _example_size(b) for n, b in dims.items()}

    def sample(roots: dict[str, int]) -> Sample:
        gen, sizes = generate.generator(seed), _derive(roots, rules)
        args = tuple(_make_tensor(s, sizes, model.device, gen) for s in model.inputs or ())
        kwargs = {k: _make_tensor(s, sizes, model.device, gen) for k, s in model.kwargs.items()}
        return args, kwargs

    dynamic_shapes = None
    if dims:
        dynamic_shapes = {}
        specs = list(zip(param_names, model.inputs or ())) + list(model.kwargs.items())
        for pname, spec in specs:
            axes = {i: made[d] for i, d in enumerate(spec.shape) if isinstance(d, str)}
            dynamic_shapes[pname] = axes or None
    return InputPlan(
        export_sample=sample(example),
        verify_samples=[(label, sample(sizes)) for label, sizes in _verify_sizes(dims, example)],
        dynamic_shapes=dynamic_shapes,
        dims=_derived_ranges({n: (b.min if b.min is not None else 0, b.max) for n, b in dims.items()}, rules),
        rules=rules,
        description={
            "args": [_describe(s) for s in model.inputs or ()],
            "kwargs": {k: _describe(s) for k, s in model.kwargs.items()},
        },
        axis_names=[
            {i: d for i, d in enumerate(s.shape) if isinstance(d, str)}
            for s in (*(model.inputs or ()), *model.kwargs.values())
        ],
        values=[(s.low, s.high) for s in (*(model.inputs or ()), *model.kwargs.values())],
        seed=seed,
    )


def normalise_samples(value: Any) -> list[Sample]:
    """Accept a tensor, a tuple of positional arguments, an ``(args, kwargs)`` pair, or a list of those."""

    def one(item: Any) -> Sample:
        if isinstance(item, torch.Tensor):
            return (item,), {}
        if (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], (tuple, list))
            and isinstance(item[1], dict)
        ):
            return tuple(item[0]), dict(item[1])
        if isinstance(item, tuple):
            return item, {}
        raise InputError(
            "example-inputs",
            "must return a sample or a list of samples; a sample is a tensor, a tuple of forward's "
            f'positional arguments such as (x, mask), or a pair ((x,), {{"mask": m}}); got {type(item).__name__}',
        )

    if isinstance(value, list):
        if not value:
            raise InputError("example-inputs", "returned an empty list of samples")
        return [one(v) for v in value]
    return [one(value)]


def plan_from_samples(model: ModelSpec, samples: list[Sample], param_names: list[str]) -> InputPlan:
    """Infer dynamic dims from several samples (see docs/configuration.md, "Dynamic dims").

    An axis whose size differs between samples is dynamic. Axes whose sizes move in
    lockstep across all samples are the same dim (a shared batch or sequence length).
    Bounds cover what was seen unless ``dynamic`` widens them.
    """
    specs = [pytree.tree_flatten(s) for s in samples]
    first_leaves, first_spec = specs[0]
    for i, (_, spec) in enumerate(specs[1:], start=1):
        if spec != first_spec:
            raise InputError("example-inputs", f"sample {i} has a different structure from sample 0")
    tensors = [i for i, leaf in enumerate(first_leaves) if isinstance(leaf, torch.Tensor)]
    for i, (leaves, _) in enumerate(specs[1:], start=1):
        for t in tensors:
            if leaves[t].dim() != first_leaves[t].dim():
                raise InputError(
                    "example-inputs",
                    f"sample {i}: input {t} has rank {leaves[t].dim()}, sample 0 has {first_leaves[t].dim()}",
                )

    # Group varying axes by their size sequence across samples.
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for t in tensors:
        for axis in range(first_leaves[t].dim()):
            seq = tuple(int(leaves[t].shape[axis]) for leaves, _ in specs)
            if len(set(seq)) > 1:
                groups.setdefault(seq, []).append((t, axis))
    names: dict[tuple[int, int], str] = {}
    dims: dict[str, tuple[int, int | None]] = {}
    rules = _rules(model)
    for k, (seq, members) in enumerate(groups.items()):
        name = "batch" if any(axis == 0 for _, axis in members) and "batch" not in dims else f"dim{k}"
        if name not in rules:
            dims[name] = _widen(name, _bounds_of(model, name), min(seq), max(seq))
        for member in members:
            names[member] = name
    inferred = set(names.values())
    for name in rules:
        if name not in inferred:
            raise InputError(
                f"dynamic.{name}",
                f"no inferred dim is called {name!r}; inferred: "
                f"{', '.join(sorted(inferred)) or 'none (no size differs between samples)'}",
            )
    for root, _, _ in rules.values():
        if root not in dims:  # a new dim, not one of the inferred
            bounds = _bounds_of(model, root)
            dims[root] = (bounds.min or 0, bounds.max)
    roots, dims = dims, _derived_ranges(dims, rules)
    for name in model.dynamic:
        if name not in dims:
            raise InputError(
                f"dynamic.{name}",
                f"no inferred dim is called {name!r}; inferred: "
                f"{', '.join(dims) or 'none (no size differs between samples)'}",
            )

    # Export from the sample whose dynamic sizes are all >= 2 (size 1 would be specialised).
    order = sorted(
        range(len(samples)), key=lambda i: min([int(specs[i][0][t].shape[a]) for (t, a) in names] or [2]) < 2
    )
    export_index = order[0]
    dynamic_shapes = None
    if dims:
        made = torch_dims(roots, rules)
        per_leaf = [
            {a: made[names[(t, a)]] for (tt, a) in names if tt == t} or None if isinstance(leaf, torch.Tensor) else None
            for t, leaf in enumerate(first_leaves)
        ]
        args_shapes, kwargs_shapes = pytree.tree_unflatten(per_leaf, first_spec)
        dynamic_shapes = dict(zip(param_names, args_shapes))
        dynamic_shapes.update(kwargs_shapes)

    samples = [*samples]
    samples[export_index] = _contiguous(samples[export_index])
    verify = [(f"sample {i}", s) for i, s in enumerate(samples)]
    if dims:
        base = samples[export_index]
        for label, pick in (("min", 0), ("max", 1)):
            target = {n: size for n, b in dims.items() if (size := b[pick]) is not None}
            seen = all(
                any(int(specs[i][0][t].shape[a]) == target.get(names[(t, a)]) for i in range(len(samples)))
                for (t, a) in names
            )
            if not seen:
                verify.append((label, _resize(base, names, target)))
    leaves_desc = [
        {"shape": [names.get((t, a), int(s)) for a, s in enumerate(leaf.shape)], "dtype": str(leaf.dtype)[6:]}
        if isinstance(leaf, torch.Tensor)
        else repr(leaf)
        for t, leaf in enumerate(first_leaves)
    ]
    return InputPlan(
        export_sample=samples[export_index],
        verify_samples=verify,
        dynamic_shapes=dynamic_shapes,
        dims=dims,
        rules=rules,
        description={"samples": len(samples), "leaves": leaves_desc},
        axis_names=[{a: n for (tt, a), n in names.items() if tt == t} for t in tensors],
        values=[_seen_range([pytree.tree_leaves(s)[t] for s in samples]) for t in tensors],
    )


@dataclass
class Planned:
    """A model's input plan, with what its checks and a second export need of it."""

    plan: InputPlan
    replan: Callable[[ModelSpec], InputPlan]
    """The plan again, for the spec with other ``dynamic`` entries (the rules export suggests)."""
    export_label: str | None
    """The sample export uses, named as the user knows it (``sample N`` of ``example-inputs``); ``None``
    for declared inputs."""


def plan_model(model: ModelSpec, param_names: list[str], returned: Any = None) -> Planned:
    """The model's input plan in one pass: from its declared ``inputs``, or from what its ``example-inputs``
    returned (``returned``: its samples are normalised once, and kept for a plan made again). An
    :class:`InputError` names the key at fault."""
    if model.example_inputs is None:

        def replan(spec: ModelSpec) -> InputPlan:
            return plan_declared(spec, param_names)

    else:
        samples = normalise_samples(returned)

        def replan(spec: ModelSpec) -> InputPlan:
            return plan_from_samples(spec, samples, param_names)

    plan = replan(model)
    return Planned(plan, replan, _export_label(plan))


def _export_label(plan: InputPlan) -> str | None:
    """``sample N`` where export uses one of ``example-inputs``' samples; else ``None``."""
    for label, sample in plan.verify_samples:
        if sample is plan.export_sample and label.startswith("sample"):
            return label
    return None


_FIX_DIM = re.compile(r"^(\w+) = Dim\('(\w+)'(?:, min=(\d+))?(?:, max=(\d+))?\)$")
_FIX_RULE = re.compile(r"^(\w+) = (.+)$")


def suggested_rules(message: str, known: set[str], rules: Rules) -> dict[str, DimSpec | str] | None:
    """The relations torch.export suggests between dims (``samples = 320*_samples`` over a new root
    ``_samples = Dim('_samples', min=10, max=20)``), as ``dynamic`` entries; ``None`` where it suggests
    anything else (narrower bounds, a static size), which would change what the user declared, or a
    rule over a derived dim or for a dim that other rules are over (``rules``: those in force).
    torch leaves out a ``min`` of 2.

    torch's own ``refine_dynamic_shapes_from_suggested_fixes`` fails on such messages (torch 2.13).
    """
    _, found, fixes = message.partition("Suggested fixes:")
    out: dict[str, DimSpec | str] = {}
    for line in fixes.strip().split("\n\n")[0].splitlines():
        line = line.strip()
        if (dim := _FIX_DIM.match(line)) and dim[1] == dim[2] and dim[1] not in known:
            out[dim[1]] = DimSpec(int(dim[3]) if dim[3] else 2, int(dim[4]) if dim[4] else None)
        elif (rule := _FIX_RULE.match(line)) and rule[1] in known and parse_rule(rule[2]) is not None:
            out[rule[1]] = rule[2]
        else:
            return None
    roots = {parsed[0] for value in out.values() if isinstance(value, str) and (parsed := parse_rule(value))}
    over = {root for root, _, _ in rules.values()}
    chained = (roots & set(rules)) or (set(out) & over)
    return out if found and out and roots <= known | set(out) and not chained else None


def describe_rules(rules: dict[str, Any]) -> str:
    """``samples = 320*_samples, _samples in [10, 20]``."""
    return ", ".join(
        f"{name} = {value}"
        if isinstance(value, str)
        else f"{name} in [{value.min or 0}, {value.max if value.max is not None else 'inf'}]"
        for name, value in rules.items()
    )


def _seen_range(tensors: list[torch.Tensor]) -> tuple[float | None, float | None]:
    """The integers the samples hold, as a generator's ``[low, high)``: inputs remade from the manifest
    then index what the project's did. Other dtypes keep the generator's default."""
    if any(t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex or not t.numel() for t in tensors):
        return None, None
    return min(int(t.min()) for t in tensors), max(int(t.max()) for t in tensors) + 1


def _contiguous(sample: Sample) -> Sample:
    """The sample with contiguous tensors: compiled code assumes the layout it was exported with,
    and the loader makes every input contiguous."""
    leaves, spec = pytree.tree_flatten(sample)
    if all(leaf.is_contiguous() for leaf in leaves if isinstance(leaf, torch.Tensor)):
        return sample
    return pytree.tree_unflatten([x.contiguous() if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def _widen(name: str, declared: DimSpec, low: int, high: int) -> tuple[int, int]:
    """Bounds covering the sizes seen, widened by ``dynamic``; narrowing them would refuse a sample."""
    if declared.min is not None and declared.min > low:
        raise InputError(
            f"dynamic.{name}.min",
            f"is {declared.min}, above the smallest size of {name!r} in the "
            f"samples ({low}); `dynamic` can only widen the range the samples show",
        )
    if declared.max is not None and declared.max < high:
        raise InputError(
            f"dynamic.{name}.max",
            f"is {declared.max}, below the largest size of {name!r} in the "
            f"samples ({high}); `dynamic` can only widen the range the samples show",
        )
    return (low if declared.min is None else declared.min, high if declared.max is None else declared.max)


def resized(plan: InputPlan, roots: dict[str, int]) -> Sample:
    """The export sample with its dynamic axes at the sizes ``roots`` gives (derived dims follow their rules)."""
    leaves = pytree.tree_leaves(plan.export_sample)
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    names = {(tensors[p], axis): name for p, axes in enumerate(plan.axis_names) for axis, name in axes.items()}
    return _resize(plan.export_sample, names, _derive(roots, plan.rules))


def _resize(sample: Sample, names: dict[tuple[int, int], str], target: dict[str, int]) -> Sample:
    """A copy of ``sample`` with dynamic axes set to ``target`` sizes (values repeated)."""
    leaves, spec = pytree.tree_flatten(sample)
    out = []
    for t, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            for (tt, axis), name in names.items():
                if tt == t and name in target:
                    size = target[name]
                    reps = max(1, -(-size // max(leaf.shape[axis], 1)))
                    leaf = torch.cat([leaf] * reps, dim=axis).narrow(axis, 0, size)
        out.append(leaf)
    return pytree.tree_unflatten(out, spec)


__all__ = [
    "InputError",
    "InputPlan",
    "resized",
    "rule_text",
    "suggested_rules",
    "torch_dims",
    "Sample",
    "default_tolerances",
    "normalise_samples",
    "plan_declared",
    "plan_from_samples",
    "plan_model",
    "Planned",
    "describe_rules",
]
