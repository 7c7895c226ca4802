"""The function ``load()`` returns: the call checked as eager would check it, then the runner; outputs
in the eager model's structure and types, and the inputs it writes into written as eager writes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .aliasing import callers
from .engine import Model
from .fastpath import generated, output_expr
from .inputs import contiguous, fits, resolved, write_back


def aoti_call(engine: Model) -> Callable[..., Any]:
    """The function ``load()`` returns: the eager model's call signature, checked, then the runner.

    Its code is generated for the model's own input and output structure (plain indexing
    and comparisons, no tree walk), since the runner is fast enough that a generic
    flatten would cost more than the call itself. Anything the generated code does not
    expect takes the generic path, which either runs the call or raises the right error.
    """
    tensors_of = checker(engine)
    finish = finisher(engine)

    def generic(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tensors = tensors_of(args, kwargs)
        prepared = resolved(tensors) if engine.complex else contiguous(tensors)
        return finish(tensors, prepared, engine.run(list(prepared)))  # torch's fallback runner empties it

    return named(generated(engine, generic), engine)


def checked_call(engine: Model) -> Callable[..., Any]:
    """The function ``load()`` returns for other backends: the same checks, then their callable."""
    run, tensors_of = engine.run, checker(engine)

    def model(*args: Any, **kwargs: Any) -> Any:
        return run(tensors_of(args, kwargs), args, kwargs)

    return named(model, engine)


def checker(engine: Model) -> Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]:
    """A function from a call's inputs to its tensors in compiled order, raising for any that does not fit."""
    flatten, reject, checks, strided = engine.flatten, engine.reject, engine.checks, engine.strided
    indices, writes = bool(engine.index_rows), engine.unsafe is not None

    def tensors_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        tensors = flatten(args, kwargs)
        roots: dict[str, int] = {}
        for tensor, (dtype, cpu, sizes, dims) in zip(tensors, checks):
            try:
                ok = (
                    tensor.dtype is dtype
                    and tensor.is_cpu is cpu
                    and (cpu or tensor.is_cuda)
                    and tensor.layout is strided
                )
                if ok:
                    ok = fits(tensor.shape, sizes, dims, roots) if dims else tensor.shape == sizes
            except AttributeError:
                ok = False
            if not ok:
                reject(tensors)
        if indices:
            engine.check_indices(tensors)
        if writes:
            engine.check_writes(tensors)
        return tensors

    return tensors_of


def named(model: Callable[..., Any], engine: Model) -> Callable[..., Any]:
    model.__name__ = model.__qualname__ = engine.name
    model.__module__ = package = __name__.rpartition(".")[0]
    model.__doc__ = f"Compiled model {engine.name!r} on {engine.device}; see {package}.info({engine.name!r})."
    attributes = {
        "name": engine.name,
        "device": engine.device,
        "file": engine.file,
        "runner": engine.runner,  # torch's runner underneath (private torch API), for benchmarks
        "weights": engine.weights,  # the mapped weights the runner uses: they live as long as the model
    }
    for attribute, value in attributes.items():
        setattr(model, attribute, value)
    return model


def finisher(engine: Model) -> Callable[[list[Any], list[Any], list[Any]], Any]:
    """For the generic path: mutations written back, outputs in the eager model's structure and types."""
    env: dict[str, Any] = {}
    code = f"lambda o: {output_expr(engine, env)}"
    outputs = eval(code, env)
    mutated, views = engine.mutated, engine.views

    def finish(tensors: list[Any], prepared: list[Any], flat: list[Any]) -> Any:
        write_back(tensors, prepared, mutated)
        return outputs(callers(flat, prepared, tensors, views))

    return finish
