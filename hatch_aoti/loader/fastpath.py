"""The generated fast path of an AOTInductor model's call: plain indexing and comparisons written
for the model's own input and output structure, since the runner is fast enough that a generic
tree walk would cost more than the call.

Numbers from the manifest enter the code only through ``int()``, and any other value through a name
in its globals: a damaged manifest fails to load, it never becomes code."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from .aliasing import callers
from .engine import Model
from .specs import children as children_of


class Miss(Exception):
    """The generated fast path does not take this call."""


MISSES = (Miss, LookupError, TypeError, AttributeError)


def generated(engine: Model, generic: Callable[..., Any]) -> Callable[..., Any]:
    """Compile the model's call function; ``generic(args, kwargs)`` takes whatever it does not."""
    env: dict[str, Any] = {
        "_run": engine.run,
        "_generic": generic,
        "_Miss": Miss,
        "_MISSES": MISSES,
        "_strided": engine.strided,
    }
    lines, leaves = _unpacking(engine, env)
    if leaves is None or not _inline_checks(engine, leaves, lines, env):
        return lambda *args, **kwargs: generic(args, kwargs)
    tensors = [leaves[i] for i in engine.tensor_index]
    body = [
        "def model(*args, **kwargs):",
        "    try:",
        *lines,
        "    except _MISSES:",
        "        pass",
        "    else:",
        *_calling(engine, tensors, env),
        "    return _generic(args, kwargs)",
    ]
    # The call runs in the else branch, outside the handler: its errors never show the Miss.
    exec("\n".join(body), env)
    model: Callable[..., Any] = env["model"]
    return model


def _unpacking(engine: Model, env: dict[str, Any]) -> tuple[list[str], list[str] | None]:
    """Lines that bind each input leaf to ``v<i>``, checking the containers on the way; (lines, None)
    where a container is of another type than tuple, list or dict (the generic path takes those)."""
    args_spec, kwargs_spec = children_of(engine.in_spec)
    counts = f"len(args) != {int(args_spec.num_children)} or len(kwargs) != {len(engine.kwarg_names)}"
    lines = [f"        if {counts}: raise _Miss"]
    leaves: list[str] = []
    nodes = itertools.count()

    def walk(spec: Any, expr: str) -> bool:
        if spec.is_leaf():
            leaves.append(f"v{len(leaves)}")
            lines.append(f"        {leaves[-1]} = {expr}")
            return True
        var, children = f"n{next(nodes)}", children_of(spec)
        lines.append(f"        {var} = {expr}")
        if spec.type in (tuple, list):
            lines.append(
                f"        if type({var}) is not {spec.type.__name__} or len({var}) != {len(children)}: raise _Miss"
            )
            return all(walk(c, f"{var}[{i}]") for i, c in enumerate(children))
        if spec.type is dict:
            env[f"K{var}"] = frozenset(spec.context)
            lines.append(f"        if type({var}) is not dict or {var}.keys() != K{var}: raise _Miss")
            return all(walk(c, f"{var}[{_key(env, k)}]") for k, c in zip(spec.context, children))
        return False

    ok = all(walk(c, f"args[{i}]") for i, c in enumerate(children_of(args_spec)))
    ok = ok and all(walk(c, f"kwargs[{_key(env, k)}]") for k, c in zip(engine.kwarg_names, children_of(kwargs_spec)))
    return lines, leaves if ok else None


def _key(env: dict[str, Any], key: Any) -> str:
    """A dict key in generated code: a string as its literal, anything else by a name in its globals."""
    if type(key) is str:
        return repr(key)
    env[f"Q{len(env)}"] = key
    return f"Q{len(env) - 1}"


def _calling(engine: Model, tensors: list[str], env: dict[str, Any]) -> list[str]:
    """Lines that make the inputs contiguous, run, write back the inputs the model writes, and return."""
    lines: list[str] = []
    for position, var in enumerate(tensors):
        if engine.checks[position][0].is_complex:
            lines.append(f"        c{position} = {var}.resolve_conj().resolve_neg().contiguous()")
        else:
            lines.append(f"        c{position} = {var} if {var}.is_contiguous() else {var}.contiguous()")
    copies = ", ".join(f"c{p}" for p in range(len(tensors)))
    lines.append(f"        o = _run([{copies}])")
    for position in engine.mutated:  # the caller's tensor changes as it would in eager
        lines.append(f"        if c{position} is not {tensors[position]}: {tensors[position]}.copy_(c{position})")
    if tensors:  # an output that is an input is the caller's tensor, not the loader's copy of it
        env["_callers"], env["_views"] = callers, engine.views
        copied = " or ".join(f"c{p} is not {var}" for p, var in enumerate(tensors))
        lines.append(f"        if {copied}: o = _callers(o, [{copies}], [{', '.join(tensors)}], _views)")
    lines.append(f"        return {output_expr(engine, env)}")
    return lines


def _inline_checks(engine: Model, leaves: list[str], lines: list[str], env: dict[str, Any]) -> bool:
    """The per-tensor checks as generated lines; False if a leaf needs the generic path."""
    roots: dict[str, str] = {}
    if any("const" in leaf and not leaf.get("check_const") for leaf in engine.leaves):
        return False  # a constant that is not a plain value: compared by the generic path only
    for index, value in engine.constants:
        env[f"C{index}"] = value
        lines.append(
            f"        if type({leaves[index]}) is not type(C{index}) or {leaves[index]} != C{index}: raise _Miss"
        )
    for position, (dtype, cpu, sizes, dims) in enumerate(engine.checks):
        var = leaves[engine.tensor_index[position]]
        env[f"D{position}"] = dtype
        tests = [
            f"{var}.dtype is D{position}",
            f"{var}.is_cpu" if cpu else f"{var}.is_cuda",
            f"{var}.layout is _strided",
        ]
        if not dims:
            env[f"S{position}"] = sizes
            lines.append(f"        if not ({' and '.join([*tests, f'{var}.shape == S{position}'])}): raise _Miss")
            continue
        static = [f"s[{axis}] == {int(size)}" for axis, size in enumerate(sizes) if size is not None]
        lines.append(f"        if not ({' and '.join(tests)}): raise _Miss")
        lines.append(f"        s = {var}.shape")
        lines.append(f"        if not ({' and '.join([f'len(s) == {len(sizes)}', *static])}): raise _Miss")
        for axis, low, high, root, mult, offset in dims:
            bounds = f"{int(low)} <= s[{axis}]" + ("" if high == float("inf") else f" <= {int(high)}")
            value = f"s[{axis}]" if (mult, offset) == (1, 0) else f"(s[{axis}] - {int(offset)}) // {int(mult)}"
            rule = "" if mult == 1 else f" and (s[{axis}] - {int(offset)}) % {int(mult)} == 0"
            lines.append(f"        if not ({bounds}{rule}): raise _Miss")
            if root in roots:
                lines.append(f"        if {value} != {roots[root]}: raise _Miss")
            else:
                roots[root] = f"r{len(roots)}"
                lines.append(f"        {roots[root]} = {value}")
    if engine.index_rows:
        env["_aminmax"] = engine.aminmax
    if engine.unsafe is not None:  # the generic path raises the error
        env["_unsafe"] = engine.unsafe
        tensors = [leaves[i] for i in engine.tensor_index]
        lines.append(f"        if _unsafe([{', '.join(tensors)}]) is not None: raise _Miss")
    for position, rows in engine.index_rows:  # out of range: the generic path raises the IndexError
        var = leaves[engine.tensor_index[position]]
        lines.append(f"        if {var}.numel():")
        lines.append(f"            lo, hi = _aminmax({var})")
        lines.append(f"            if int(lo) < 0 or int(hi) >= {int(rows)}: raise _Miss")
    return True


def output_expr(engine: Model, env: dict[str, Any]) -> str:
    """An expression of ``o`` (the runner's flat outputs) in the eager model's output structure and types."""
    flat = []
    for i, out in enumerate(engine.outputs):
        kind = out["kind"]
        if kind == "const":
            env[f"O{i}"] = out["value"]
            flat.append(f"O{i}")
        elif kind in ("int", "float", "bool"):
            flat.append(f"{kind}(o[{i}])")
        else:
            flat.append(f"o[{i}]")
    leaves = iter(flat)

    def build(spec: Any) -> str:
        if spec.is_leaf():
            return next(leaves)
        children = [build(c) for c in children_of(spec)]
        if spec.type is tuple:
            return f"({', '.join(children)},)" if children else "()"
        if spec.type is list:
            return f"[{', '.join(children)}]"
        if spec.type is dict:
            return "{" + ", ".join(f"{_key(env, k)}: {c}" for k, c in zip(spec.context, children)) + "}"
        raise Miss

    try:
        return build(engine.out_spec)
    except Miss:  # another container type: pytree rebuilds it
        env["_unflatten"], env["_spec"] = engine.pytree.tree_unflatten, engine.out_spec
        return f"_unflatten([{', '.join(flat)}], _spec)"
