"""Exact rewrites of an exported program before Inductor compiles it, where Inductor's lowering of
an op is far slower than eager's and an equal op is not (figures: docs/configuration.md#fast-defaults)."""

from __future__ import annotations

import math
from typing import Any


def whole_window_pools(exported: Any) -> int:
    """Turn each average pool whose one window covers its whole input into a mean over those dims, in
    the program and in its subgraphs; how many it turned. Inductor sums such a window over the kernel's
    size, not the input's, testing each place against the input's bounds (transformers' EfficientNet
    pools 7 x 7 with a kernel of 2560). Eager clips the window to the input and divides by what is left
    of it: the mean. The node keeps its name, by which outputs are recorded."""
    import torch

    turned = 0
    for module in exported.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule) and (count := _turn_pools(module.graph)):
            module.recompile()
            turned += count
    return turned


def _turn_pools(graph: Any) -> int:
    """Turn the whole-window pools of one graph into means; how many it turned."""
    import torch

    aten, turned = torch.ops.aten, 0
    pools = {aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}
    for node in graph.nodes:
        dims = pools.get(node.target) if node.op == "call_function" else None
        if dims is not None and _whole_window(node, dims):
            node.target, node.args, node.kwargs = aten.mean.dim, (node.args[0], list(range(-dims, 0)), True), {}
            _trace_again(node)
            turned += 1
    return turned


def _trace_again(node: Any) -> None:
    """Give a rewritten node its own op's traced value and metadata: a mean's strides may differ
    from the pool's it replaces."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    val = node.args[0].meta["val"]
    with val.fake_mode:
        node.meta["val"] = node.target(val, *node.args[1:])
    if "tensor_meta" in node.meta:
        node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
    node.meta["original_aten"] = node.target


def _whole_window(node: Any, dims: int) -> bool:
    """Whether the pool ``node`` is one window at offset 0 that covers every element of its floating
    input of static size, with no divisor given: the window is clipped to the input, and eager divides
    by the input's size (an integer pool rounds, and ``mean`` refuses integers)."""
    names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    given = dict(zip(names, node.args[1:])) | dict(node.kwargs)
    val, out = node.args[0].meta.get("val"), node.meta.get("val")
    if getattr(val, "fake_mode", None) is None or out is None or given.get("divisor_override") is not None:
        return False  # no traced value to size the window by, or a divisor of its own
    if not val.dtype.is_floating_point:
        return False
    kernel, padding = _per_dim(given["kernel_size"], dims), _per_dim(given.get("padding", 0), dims)
    sizes, outs = list(val.shape[-dims:]), list(out.shape[-dims:])
    if not all(isinstance(n, int) for n in [*sizes, *outs, *kernel, *padding]):
        return False  # a dynamic size: the window may not cover it at every size
    covered = all(k >= n for k, n in zip(kernel, sizes))
    return outs == [1] * dims and not any(padding) and covered and math.prod(sizes) > 0


def _per_dim(value: Any, dims: int) -> list[Any]:
    """A pool's size argument, one per spatial dim (an int, or a list of one, applies to each)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return values * dims if len(values) == 1 else values
