"""Rewrites of an exported program that keep what it computes from finite weights, made before Inductor
compiles it, where Inductor's lowering of an op is far slower than that of an equal one (figures:
docs/configuration.md#fast-defaults)."""

from __future__ import annotations

import math
from typing import Any


def whole_window_pools(exported: Any) -> int:
    """Turn each average pool whose one window covers its whole input into a mean over those dims, in
    the program and in its subgraphs; how many it turned. Inductor sums such a window over the kernel's
    size, not the input's, testing each place against the input's bounds (transformers' EfficientNet
    pools 7 x 7 with a kernel of 2560). Eager clips the window to the input and divides by what is left
    of it: the mean. The node keeps its name, by which outputs are recorded."""
    return _each_graph(exported, _turn_pools)


def zero_pads_into_convolutions(exported: Any) -> int:
    """Fold each zero pad, even on both sides, whose only user is a convolution into that convolution's
    own padding; how many it folded. Inductor copies the padded input in a kernel of its own
    (transformers' MobileNetV2 pads before each convolution, as TensorFlow does), where the
    convolution's padding costs nothing: it leaves out the products with zeros (which only a weight
    of inf or nan would have made other than zero)."""
    return _each_graph(exported, _fold_pads)


def _each_graph(exported: Any, rewrite: Any) -> int:
    """Apply ``rewrite`` to the program's graph and its subgraphs'; how many nodes it rewrote."""
    import torch

    turned = 0
    for module in exported.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule) and (count := rewrite(module.graph)):
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


def _fold_pads(graph: Any) -> int:
    """Fold the even zero pads of one graph into the convolutions that read them, pads of pads too;
    how many it folded."""
    folded = 0
    for conv in list(graph.nodes):
        while _fold_pad(graph, conv):
            folded += 1
    return folded


def _fold_pad(graph: Any, conv: Any) -> bool:
    """Fold the pad that ``conv`` reads into it, where it is an even zero pad read by ``conv`` alone."""
    args = _convolution_args(conv)
    if args is None or not _read_once(pad := args[0], conv):
        return False
    padded = _even_zero_pad(pad, len(args[4]))
    if padded is None:
        return False
    args[0], args[4] = padded[0], [p + a for p, a in zip(args[4], padded[1])]
    conv.args, conv.kwargs = tuple(args), {}
    _trace_again(conv)
    graph.erase_node(pad)
    return True


def _read_once(value: Any, conv: Any) -> bool:
    """Whether the node ``value`` is read by ``conv`` alone, as its input only."""
    read = [arg for arg in (*conv.args, *conv.kwargs.values()) if arg is value]
    return list(value.users) == [conv] and len(read) == 1


def _convolution_args(node: Any) -> list[Any] | None:
    """A forward convolution's arguments, all given, padding as one int per spatial dim; None for
    any other node, a transposed convolution, or padding given by name ("same")."""
    import torch

    aten = torch.ops.aten
    names = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]
    if node.op != "call_function" or node.target not in (
        aten.conv1d.default,
        aten.conv2d.default,
        aten.conv3d.default,
        aten.convolution.default,
    ):
        return None
    if node.target is aten.convolution.default:
        names[6:] = ["transposed", "output_padding", "groups"]
    given = dict(zip(names, node.args)) | dict(node.kwargs)
    weight = getattr(given.get("weight"), "meta", {}).get("val")
    if weight is None or given.get("transposed", False):
        return None
    dims = weight.dim() - 2
    given = {"bias": None, "stride": [1] * dims, "padding": 0, "dilation": [1] * dims, "groups": 1} | given
    given["padding"] = _per_dim(given["padding"], dims)
    return [given[name] for name in names] if all(isinstance(p, int) for p in given["padding"]) else None


def _even_zero_pad(pad: Any, dims: int) -> tuple[Any, list[int]] | None:
    """The input of ``pad`` and what it adds on each side of each of the last ``dims`` dims, where it is
    a constant zero pad of those dims only, the same on both sides of each; None otherwise."""
    import torch

    aten = torch.ops.aten
    if pad.op != "call_function" or pad.target not in (aten.pad.default, aten.constant_pad_nd.default):
        return None
    names = ["input", "pad", "mode", "value"] if pad.target is aten.pad.default else ["input", "pad", "value"]
    given = {"mode": "constant", "value": None} | dict(zip(names, pad.args)) | dict(pad.kwargs)
    sides = list(given["pad"])
    if given["mode"] != "constant" or given["value"] not in (None, 0) or len(sides) > 2 * dims:
        return None
    sides += [0] * (2 * dims - len(sides))
    before, after = sides[0::2][::-1], sides[1::2][::-1]  # pad lists the last dim first
    if not all(isinstance(n, int) and n >= 0 for n in sides) or before != after:
        return None
    return given["input"], before


def _trace_again(node: Any) -> None:
    """Give a rewritten node its own op's traced value and metadata: a mean's strides may differ
    from the pool's it replaces, and a convolution that reads the pad's input may differ too."""
    import torch
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    val = node.args[0].meta["val"]
    args = torch.fx.node.map_arg(node.args, lambda arg: arg.meta["val"])
    with val.fake_mode:
        node.meta["val"] = node.target(*args, **node.kwargs)
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
    """A pool's or a convolution's size argument, one per spatial dim (an int, or a list of one,
    applies to each)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return values * dims if len(values) == 1 else values
