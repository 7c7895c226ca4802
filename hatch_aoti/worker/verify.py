"""Compare compiled outputs with eager ones: structure, NaN/Inf, then values.

A wheel that ships wrong numbers is worse than no wheel, so any mismatch fails the
build with the largest errors found. The report of what was tried ships in the wheel;
the errors themselves do not, since they vary from run to run with the order of
parallel reductions, and a wheel's bytes must not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from hatch_aoti.worker.inputs import default_tolerances, resized


@dataclass
class Comparison:
    label: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    problems: list[str] = field(default_factory=list)
    float64_checked: bool = False
    """A float32 output passed by the float64 run, not by the tolerances alone."""


def compare(
    label: str,
    eager: Any,
    compiled: Any,
    rtol: float | None,
    atol: float | None,
    what: str = "output",
    reference: Callable[[], Any] | None = None,
) -> Comparison:
    """Compare one pytree pair (outputs, or inputs after the call); problems are collected, not raised.

    Leaves are named by their path (``output['logits']``, ``output[1]``), and a leaf of
    another type is a problem even where the values agree (a 0-d tensor is not an int).
    ``reference`` makes the float64 run's outputs; it is called only where one is needed.
    """
    result = Comparison(label)
    e_leaves, e_spec = pytree.tree_flatten_with_path(eager)
    c_leaves, c_spec = pytree.tree_flatten(compiled)
    if e_spec != c_spec:
        result.problems.append(f"{what} structure differs: eager {e_spec}, compiled {c_spec}")
        return result
    wide = _Leaves(reference, len(c_leaves))
    for index, ((path, e), c) in enumerate(zip(e_leaves, c_leaves)):
        where = f"{what}{pytree.keystr(path)}"
        if not isinstance(e, torch.Tensor):
            if type(e) is not type(c) or e != c:
                result.problems.append(f"{where}: eager {_shown(e)}, compiled {_shown(c)}")
            continue
        if not isinstance(c, torch.Tensor):
            result.problems.append(f"{where}: compiled returned {type(c).__name__}, eager a tensor")
            continue
        untold = rtol is None and atol is None  # a tolerance given makes eager alone the measure
        r = wide.leaf(index) if untold and e.dtype in LOW_PRECISION else None
        if isinstance(r, torch.Tensor):
            compare_with_reference(where, e, c, r, result)
        else:
            fallback = wide.leaf if untold and e.dtype == torch.float32 else None
            compare_tensors(where, e, c, rtol, atol, result, fallback, index)
    return result


class _Leaves:
    """The float64 run's output leaves, made on first need; ``None`` for each where it cannot run."""

    def __init__(self, make: Callable[[], Any] | None, count: int) -> None:
        self.make, self.count, self.leaves = make, count, None if make else [None] * count

    def leaf(self, index: int) -> Any:
        if self.leaves is None:
            found = pytree.tree_leaves(self.make()) if self.make else []
            self.leaves = found if len(found) == self.count else [None] * self.count
        return self.leaves[index]


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def compare_tensors(
    where: str,
    e: Any,
    c: Any,
    rtol: float | None,
    atol: float | None,
    result: Comparison,
    reference: Callable[[int], Any] | None = None,
    index: int = 0,
) -> None:
    """One tensor pair: shape, dtype, NaN/Inf where eager has none, then values within tolerance.

    A float32 output outside the default tolerances is measured against a float64 run as well
    (``reference``, given only where no tolerance was): in a deep network the error grows with
    the output's overall size, so an element near zero fails any relative tolerance."""
    e, c = e.detach().cpu(), c.detach().cpu()
    if not _comparable(where, e, c, result):
        return
    default_rtol, default_atol = default_tolerances(e.dtype)
    r = default_rtol if rtol is None else rtol
    a = default_atol if atol is None else atol
    if e.numel() == 0:
        return
    wide = torch.complex128 if e.is_complex() else torch.float64
    ed, cd = e.to(wide), c.to(wide)
    max_abs, max_rel = _record_errors(ed, cd, result)
    try:
        torch.testing.assert_close(cd, ed, rtol=r, atol=a, equal_nan=True)
    except AssertionError:
        problem = f"values differ beyond rtol={r:g}, atol={a:g} (max abs err {max_abs:.3g}, max rel err {max_rel:.3g})"
        exact = reference(index) if reference is not None and _same_non_finite(ed, cd) else None
        if isinstance(exact, torch.Tensor):
            further = _further_than_eager(e, c, exact, Comparison(result.label), worst_too=True)
            if further is None:
                result.float64_checked = True
                return
            problem += f"; {further}"
        result.problems.append(f"{where}: {problem}")


def _same_non_finite(ed: Any, cd: Any) -> bool:
    """NaN and Inf in the same places, with the same values: the float64 run judges only the numbers."""
    bad = ~torch.isfinite(ed)
    if not torch.equal(bad, ~torch.isfinite(cd)):
        return False
    e, c = ed[bad], cd[bad]
    return bool(((e == c) | (e.isnan() & c.isnan())).all())


def _comparable(where: str, e: Any, c: Any, result: Comparison) -> bool:
    """Same shape and dtype, and no NaN/Inf in the compiled tensor where eager has none; else the problem."""
    if e.shape != c.shape or e.dtype != c.dtype:
        result.problems.append(f"{where}: eager {e.dtype}{list(e.shape)}, compiled {c.dtype}{list(c.shape)}")
        return False
    if e.is_floating_point() or e.is_complex():
        bad = ~torch.isfinite(c) & torch.isfinite(e)
        if bool(bad.any()):
            result.problems.append(f"{where}: compiled has {int(bad.sum())} NaN/Inf values where eager has none")
            return False
    return True


def _record_errors(ed: Any, cd: Any, result: Comparison) -> tuple[float, float]:
    """The largest absolute and relative errors where both are finite (widened tensors), kept in ``result``."""
    finite = torch.isfinite(ed) & torch.isfinite(cd)
    diff = (ed - cd).abs().where(finite, torch.zeros((), dtype=torch.float64))
    rel = diff / ed.abs().clamp_min(torch.finfo(torch.float64).tiny)
    max_abs, max_rel = float(diff.max()), float(rel.where(diff > 0, torch.zeros((), dtype=torch.float64)).max())
    result.max_abs = max(result.max_abs, max_abs)
    result.max_rel = max(result.max_rel, max_rel)
    return max_abs, max_rel


#: Output dtypes whose eager results are themselves rounded as much as a compiled model may differ: checked
#: against a float64 run of the same model rather than against eager alone, as torch's own accuracy checks do.
LOW_PRECISION = (torch.bfloat16, torch.float16)
#: The compiled model may be this many times further from the float64 result than eager is...
REFERENCE_MULTIPLIER = 2.0
#: ...plus this much of the result's own size (RMS), for outputs that eager computes almost exactly
#: (for float32, about 84 of its rounding steps).
REFERENCE_FLOOR = {torch.bfloat16: 1e-3, torch.float16: 1e-3, torch.float32: 1e-5}
#: A float32 eager result this far from the float64 run (relative RMS, about 840 rounding steps) means
#: the two runs do not compute the same thing (random ops), so the run cannot judge the compiled one.
EAGER_AGREES = 1e-4


def compare_with_reference(where: str, e: Any, c: Any, r: Any, result: Comparison) -> None:
    """A low-precision output: as close to the float64 result as eager is, within the multiplier and floor."""
    e, c = e.detach().cpu(), c.detach().cpu()
    if not _comparable(where, e, c, result):
        return
    further = _further_than_eager(e, c, r, result)
    if further is not None:
        result.problems.append(f"{where}: {further}")


def _further_than_eager(e: Any, c: Any, r: Any, result: Comparison, *, worst_too: bool = False) -> str | None:
    """How the compiled tensor is too far from the float64 run ``r``, by RMS (and, with ``worst_too``, at
    its worst element: a few wrong elements barely move an RMS); ``None`` if it is as close as eager."""
    if e.shape != r.shape:
        return f"eager {e.dtype}{list(e.shape)}, float64 run {list(r.shape)}"
    floor = REFERENCE_FLOOR[e.dtype]
    e, c, r = (t.to(torch.float64) for t in (e, c, r.detach().cpu()))
    finite = torch.isfinite(e) & torch.isfinite(c) & torch.isfinite(r)  # errors where all three are numbers
    e, c, r = e[finite], c[finite], r[finite]
    if e.numel() == 0:
        return None
    _record_errors(e, c, result)

    def rms(t: Any) -> float:
        return float(t.square().mean().sqrt())

    def largest(t: Any) -> float:
        return float(t.abs().max())

    eager_rms, scale = rms(e - r), rms(r)
    if worst_too and eager_rms > EAGER_AGREES * scale:
        return f"a float64 run cannot judge it: eager itself is {eager_rms:.3g} RMS from it (a random model?)"
    measures = [("RMS error", eager_rms, rms(c - r), scale, "the output's RMS")]
    if worst_too:
        measures.append(("largest error", largest(e - r), largest(c - r), largest(r), "its largest value"))
    for what, eager_err, compiled_err, scale, of in measures:
        if compiled_err > REFERENCE_MULTIPLIER * eager_err + floor * scale:
            return (
                f"further from a float64 run than eager is ({what} {compiled_err:.3g}, eager's {eager_err:.3g}; "
                f"allowed {REFERENCE_MULTIPLIER:g}x eager's + {floor:g}x {of})"
            )
    return None


class Float64(TorchFunctionMode):
    """Every floating-point computation in float64: inputs, weights (as each op reads them, so the model
    is never copied whole) and any dtype an op is asked for. What the model's low-precision outputs are
    compared with."""

    FLOATING = (torch.bfloat16, torch.float16, torch.float32)
    DOWN = {"bfloat16", "half", "float"}
    CASTS = {"to", "type", "type_as"}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.BLOCKWISE:
            out = self.BLOCKWISE[name](self, func, args, kwargs)
            if out is not None:
                return out
        floating_cast = name in self.DOWN or (name in self.CASTS and self._to_floating(args[1:], kwargs))
        args, kwargs = pytree.tree_map(self._wide, (args, kwargs))
        if floating_cast and args and isinstance(args[0], torch.Tensor) and args[0].dtype is torch.float64:
            return args[0]  # a cast to another floating dtype would round the reference
        return func(*args, **kwargs)

    @staticmethod
    def _to_floating(args: Any, kwargs: Any) -> bool:
        """Whether a ``to``/``type``/``type_as`` call asks for a floating dtype (not a device, not an integer)."""
        for value in (*args, kwargs.get("dtype")):
            if isinstance(value, torch.dtype):
                return value.is_floating_point
            if isinstance(value, torch.Tensor):
                return value.is_floating_point()
            if isinstance(value, str) and "Tensor" in value:  # .type("torch.HalfTensor")
                return any(k in value for k in ("Half", "BFloat16", "Float", "Double"))
        return False

    def _wide(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in self.FLOATING:
            return value.to(torch.float64)
        if isinstance(value, torch.dtype) and value in self.FLOATING:
            return torch.float64
        return value

    def _embedding(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A lookup in a large table: the rows read, widened after the lookup (exact, as a lookup does
        no arithmetic), not the whole table; ``None`` where the table is small or renormalised."""
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        max_norm = args[3] if len(args) > 3 else kwargs.get("max_norm")
        if not self._large(weight) or max_norm is not None:
            return None
        return func(*args, **kwargs).to(torch.float64)

    def _linear(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A linear layer with a large weight: computed a block of output features at a time, each
        block's weight widened on its own; ``None`` where the weight is small."""
        names = ("input", "weight", "bias")
        given: dict[str, Any] = {**dict(zip(names, args)), **kwargs}
        x: Any = given.get("input")
        weight: Any = given.get("weight")
        bias: Any = given.get("bias")
        if not self._large(weight) or weight.dim() != 2 or not isinstance(x, torch.Tensor) or set(given) - set(names):
            return None
        x = self._wide(x)
        rows = max(1, self.BLOCK // (max(1, weight.shape[1]) * 8))
        blocks = [
            func(x, self._wide(weight[i : i + rows]), None if bias is None else self._wide(bias[i : i + rows]))
            for i in range(0, weight.shape[0], rows)
        ]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)

    def _large(self, weight: Any) -> bool:
        """A floating tensor whose float64 copy would pass :attr:`BLOCK`."""
        return isinstance(weight, torch.Tensor) and weight.dtype in self.FLOATING and weight.numel() * 8 > self.BLOCK

    #: The most bytes of one weight widened at once: a whole large weight in float64 (a vocabulary's
    #: embedding or output layer, 4x its bfloat16 size) would otherwise be the verification's peak.
    BLOCK = 64 << 20
    BLOCKWISE: ClassVar[dict[str, Callable[..., Any]]] = {"embedding": _embedding, "linear": _linear}


def reference(module: Any, args: Any, kwargs: Any) -> Any:
    """The model's outputs computed in float64, or ``None`` where it cannot run so."""
    try:
        with torch.no_grad(), Float64():
            return module(*args, **kwargs)
    except Exception:
        return None


def needs_reference(expected: Any, rtol: float | None, atol: float | None) -> bool:
    """Whether outputs are compared with a float64 run: some are low-precision, and no tolerance was given."""
    low = any(isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION for t in pytree.tree_leaves(expected))
    return low and rtol is None and atol is None


class VerificationFailed(Exception):
    """The compiled model failed on an input set or differs from eager; the message says how."""

    def __init__(self, message: str, *, mismatch: bool = False) -> None:
        super().__init__(message)
        self.mismatch = mismatch  # it ran, and its results differ: not a failure to run


def verify_model(
    module: Any, samples: list[tuple[str, Any]], compiled: Callable[..., Any], rtol: float | None, atol: float | None
) -> tuple[dict[str, Any], dict[str, float]]:
    """Run eager and compiled on every (label, sample) pair: (report to ship, largest errors).

    Each run gets its own copy of the inputs, and the inputs are compared after the calls
    as well as the outputs: a model that mutates its inputs must mutate them alike.
    """
    tried, worst = [], {"max_abs_err": 0.0, "max_rel_err": 0.0}
    checks: set[str] = set()
    float64_checked = False
    for label, sample in samples:
        shapes = [list(t.shape) for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor)]
        (e_args, e_kwargs), (c_args, c_kwargs) = copied(sample), copied(sample)
        with torch.no_grad():
            expected = run_or_fail(module, e_args, e_kwargs, f"eager model failed on {label} inputs {shapes}")
            actual = run_or_fail(compiled, c_args, c_kwargs, f"compiled model failed on {label} inputs {shapes}")
        wide = functools.cache(lambda sample=sample: reference(module, *copied(sample)))  # costly: at most once
        if needs_reference(expected, rtol, atol):
            checks.add("float64 reference" if wide() is not None else "eager (no float64 run)")
        result = compare(label, expected, actual, rtol, atol, reference=wide)
        float64_checked = float64_checked or result.float64_checked
        mutated = compare(label, (e_args, e_kwargs), (c_args, c_kwargs), rtol, atol, what="input")
        problems = result.problems + [f"after the call, {p}" for p in mutated.problems]
        if problems:
            raise VerificationFailed(
                f"compiled model differs from eager on {label} inputs {shapes}: " + "; ".join(problems), mismatch=True
            )
        tried.append({"inputs": label, "shapes": shapes})
        worst = {
            "max_abs_err": max(worst["max_abs_err"], result.max_abs, mutated.max_abs),
            "max_rel_err": max(worst["max_rel_err"], result.max_rel, mutated.max_rel),
        }
    report: dict[str, Any] = {"passed": True, "rtol": rtol, "atol": atol, "tried": tried}
    if checks:  # low-precision outputs: against what they were compared
        report["low_precision"] = sorted(checks)
    if float64_checked:  # in the log only: whether it was needed varies from run to run
        worst["float64_checked"] = 1.0
    return report, worst


def region_edges(plan: Any, regions: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Inputs at both ends of every compiled region of sizes (an unbounded end: 2 * its start + 1)."""
    out = []
    for region in regions:
        for label, pick in (("start", 0), ("end", 1))[: 1 if _single(region["dims"]) else 2]:
            sizes = {
                name: bounds[pick] if bounds[pick] is not None else 2 * bounds[0] + 1
                for name, bounds in region["dims"].items()
            }
            text = ", ".join(f"{name}={size}" for name, size in sizes.items())
            out.append((f"region {region['file']} {label} ({text})", resized(plan, sizes)))
    return out


def _single(dims: dict[str, list[Any]]) -> bool:
    return all(low == high for low, high in dims.values())


def summary(report: dict[str, Any] | None, errors: dict[str, float] | None) -> str:
    """The verification in one line, for the build's progress."""
    if not report or report.get("passed") is None:
        return "not verified (verify = false)"
    text = f"verified against eager on {len(report.get('tried', []))} input set(s)"
    if not errors:
        return text
    if "rel_error" in errors:  # a lower-precision variant
        return f"{text}, relative error {errors['rel_error']:.2g}, cosine {errors['cosine']:.6f}"
    checked = " (float32 outputs checked against a float64 run)" if errors.get("float64_checked") else ""
    return f"{text}, max abs err {errors['max_abs_err']:.2g}{checked}"


def rebuilt_unlike(spec: Any, backend: str) -> str | None:
    """Why a model whose module is built by its factory at load cannot match eager, if that is why:
    two calls of the factory give other weights (an unseeded initialisation)."""
    from hatch_aoti.worker.checks import factory_module

    try:
        first, second = factory_module(spec, []), factory_module(spec, [])
        ours, theirs = first.state_dict(), second.state_dict()
        differs = next((k for k, v in ours.items() if k not in theirs or not _same(v, theirs[k])), None)
    except Exception:  # no cause found: the mismatch is told as it is
        return None
    if differs is None:
        return None
    return (
        f"two calls of `factory` gave other weights (`{differs}` differs), and a model of the {backend} "
        "backend builds its module from `factory` when it loads: make the factory return the same "
        "weights each time (seed its initialisation, or load saved weights)"
    )


def _same(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return bool(a == b)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def copied(sample: Any) -> Any:
    """A copy of a sample whose tensors are clones (same strides): a call may write into them."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), sample)


def run_or_fail(fn: Callable[..., Any], args: Any, kwargs: Any, what: str) -> Any:
    """``fn``'s result; its exception as a :class:`VerificationFailed` saying what failed."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise VerificationFailed(f"{what}: {type(exc).__name__}: {first}") from None
