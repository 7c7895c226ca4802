"""Compare compiled outputs with eager ones: structure, NaN/Inf, then values.

A wheel that ships wrong numbers is worse than no wheel, so any mismatch fails the
build with the largest errors found. The report of what was tried ships in the wheel;
the errors themselves do not, since they vary from run to run with the order of
parallel reductions, and a wheel's bytes must not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hatch_aoti.worker.inputs import default_tolerances


@dataclass
class Comparison:
    label: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    problems: list[str] = field(default_factory=list)


def compare(
    label: str, eager: Any, compiled: Any, rtol: float | None, atol: float | None, what: str = "output"
) -> Comparison:
    """Compare one pytree pair (outputs, or inputs after the call); problems are collected, not raised.

    Leaves are named by their path (``output['logits']``, ``output[1]``), and a leaf of
    another type is a problem even where the values agree (a 0-d tensor is not an int).
    """
    result = Comparison(label)
    e_leaves, e_spec = pytree.tree_flatten_with_path(eager)
    c_leaves, c_spec = pytree.tree_flatten(compiled)
    if e_spec != c_spec:
        result.problems.append(f"{what} structure differs: eager {e_spec}, compiled {c_spec}")
        return result
    for (path, e), c in zip(e_leaves, c_leaves):
        where = f"{what}{pytree.keystr(path)}"
        if not isinstance(e, torch.Tensor):
            if type(e) is not type(c) or e != c:
                result.problems.append(f"{where}: eager {_shown(e)}, compiled {_shown(c)}")
            continue
        if not isinstance(c, torch.Tensor):
            result.problems.append(f"{where}: compiled returned {type(c).__name__}, eager a tensor")
            continue
        compare_tensors(where, e, c, rtol, atol, result)
    return result


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def compare_tensors(where: str, e: Any, c: Any, rtol: float | None, atol: float | None, result: Comparison) -> None:
    """One tensor pair: shape, dtype, NaN/Inf where eager has none, then values within tolerance."""
    if e.shape != c.shape or e.dtype != c.dtype:
        result.problems.append(f"{where}: eager {e.dtype}{list(e.shape)}, compiled {c.dtype}{list(c.shape)}")
        return
    e, c = e.detach().cpu(), c.detach().cpu()
    if e.is_floating_point() or e.is_complex():
        bad = ~torch.isfinite(c) & torch.isfinite(e)
        if bool(bad.any()):
            result.problems.append(f"{where}: compiled has {int(bad.sum())} NaN/Inf values where eager has none")
            return
    default_rtol, default_atol = default_tolerances(e.dtype)
    r = default_rtol if rtol is None else rtol
    a = default_atol if atol is None else atol
    if e.numel() == 0:
        return
    wide = torch.complex128 if e.is_complex() else torch.float64
    ed, cd = e.to(wide), c.to(wide)
    finite = torch.isfinite(ed) & torch.isfinite(cd)
    diff = (ed - cd).abs().where(finite, torch.zeros((), dtype=torch.float64))
    rel = diff / ed.abs().clamp_min(torch.finfo(torch.float64).tiny)
    max_abs, max_rel = float(diff.max()), float(rel.where(diff > 0, torch.zeros((), dtype=torch.float64)).max())
    result.max_abs = max(result.max_abs, max_abs)
    result.max_rel = max(result.max_rel, max_rel)
    try:
        torch.testing.assert_close(cd, ed, rtol=r, atol=a, equal_nan=True)
    except AssertionError:
        result.problems.append(
            f"{where}: values differ beyond rtol={r:g}, atol={a:g} "
            f"(max abs err {max_abs:.3g}, max rel err {max_rel:.3g})"
        )


class VerificationFailed(Exception):
    """The compiled model failed on an input set or differs from eager; the message says how."""


def verify_model(
    module: Any, samples: list[tuple[str, Any]], compiled: Callable[..., Any], rtol: float | None, atol: float | None
) -> tuple[dict[str, Any], dict[str, float]]:
    """Run eager and compiled on every (label, sample) pair: (report to ship, largest errors).

    Each run gets its own copy of the inputs, and the inputs are compared after the calls
    as well as the outputs: a model that mutates its inputs must mutate them alike.
    """
    tried, worst = [], {"max_abs_err": 0.0, "max_rel_err": 0.0}
    for label, sample in samples:
        shapes = [list(t.shape) for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor)]
        (e_args, e_kwargs), (c_args, c_kwargs) = copied(sample), copied(sample)
        with torch.no_grad():
            expected = _call(module, e_args, e_kwargs, f"eager model failed on {label} inputs {shapes}")
            actual = _call(compiled, c_args, c_kwargs, f"compiled model failed on {label} inputs {shapes}")
        result = compare(label, expected, actual, rtol, atol)
        mutated = compare(label, (e_args, e_kwargs), (c_args, c_kwargs), rtol, atol, what="input")
        problems = result.problems + [f"after the call, {p}" for p in mutated.problems]
        if problems:
            raise VerificationFailed(
                f"compiled model differs from eager on {label} inputs {shapes}: " + "; ".join(problems)
            )
        tried.append({"inputs": label, "shapes": shapes})
        worst = {
            "max_abs_err": max(worst["max_abs_err"], result.max_abs, mutated.max_abs),
            "max_rel_err": max(worst["max_rel_err"], result.max_rel, mutated.max_rel),
        }
    return {"passed": True, "rtol": rtol, "atol": atol, "tried": tried}, worst


def copied(sample: Any) -> Any:
    """A copy of a sample whose tensors are clones (same strides): a call may write into them."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), sample)


def _call(fn: Callable[..., Any], args: Any, kwargs: Any, what: str) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise VerificationFailed(f"{what}: {type(exc).__name__}: {first}") from None
