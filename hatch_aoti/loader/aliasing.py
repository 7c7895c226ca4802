"""Outputs as eager gives them where the loader ran on its own contiguous copy of an input: an
output that is that input, or a view of it, is the caller's tensor or a view of it."""

from __future__ import annotations

from typing import Any


def callers(outputs: list[Any], prepared: list[Any], tensors: list[Any], views: list[tuple[int, int]]) -> list[Any]:
    """``outputs`` as eager gives them: one of the loader's copies of an input is that input, and
    an output that eager makes as a view of an input (``views``: its index and the input's, as the
    build found them) is that view of the caller's tensor, not of the copy."""
    mine = {id(c): t for c, t in zip(prepared, tensors) if c is not t}
    outputs = [mine.get(id(o), o) for o in outputs]
    for index, position in views:
        copy, tensor = prepared[position], tensors[position]
        if copy is not tensor and outputs[index] is not tensor:
            outputs[index] = _rebased(outputs[index], copy, tensor)
    return outputs


def _rebased(output: Any, copy: Any, tensor: Any) -> Any:
    """``output``, a view of ``copy`` (the loader's contiguous copy of ``tensor``), as that view of
    ``tensor``; ``output`` itself where the caller's strides cannot express it."""
    gap = output.data_ptr() - copy.data_ptr()
    if not 0 <= gap < copy.nbytes or output.dtype != copy.dtype or not output.numel():
        return output
    offset = gap // copy.element_size()
    sizes, strides = _runs(tensor)
    start = _digits(offset, sizes)
    steps = [_digits(s, sizes) if s < copy.numel() else [0] * len(sizes) for s in output.stride()]
    reach = [start[d] + sum((n - 1) * step[d] for n, step in zip(output.shape, steps)) for d in range(len(sizes))]
    if any(r >= n for r, n in zip(reach, sizes)):
        return output  # a step would carry into a run of other strides: not a view of the caller's tensor
    in_caller = [sum(i * s for i, s in zip(step, strides)) for step in [start, *steps]]
    # detached: a compiled model's outputs carry no autograd graph
    return tensor.detach().as_strided(output.shape, in_caller[1:], tensor.storage_offset() + in_caller[0])


def _runs(tensor: Any) -> tuple[list[int], list[int]]:
    """The sizes and strides of ``tensor``'s dims, each run of dims it lays out contiguously as one."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(tensor.shape, tensor.stride()):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:
            sizes[-1], strides[-1] = sizes[-1] * size, stride
        else:
            sizes.append(size)
            strides.append(stride)
    return sizes, strides


def _digits(offset: int, sizes: list[int]) -> list[int]:
    """The index of element ``offset`` of a contiguous tensor of ``sizes``."""
    index = []
    for size in reversed(sizes):
        offset, digit = divmod(offset, size)
        index.append(digit)
    return index[::-1]
