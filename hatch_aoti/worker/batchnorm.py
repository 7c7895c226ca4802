"""Batch norms folded into the convolutions before them, for a bfloat16 variant.

A bfloat16 convolution rounds its output before the batch norm after it subtracts the channel's mean;
folded into the convolution's weights and bias (in float32, before they are rounded), the norm
costs nothing and that rounding comes after the subtraction. ResNet-50's relative error went from
0.0058 to 0.0037 (docs/performance.md#precision-variants). Which convolution feeds which norm is
read from the model's exported program, so any module layout works; the folded layers live in a
structural copy, and the model itself, the float32 reference, is left as it was.
"""

from __future__ import annotations

import collections
import operator
from typing import Any

import torch

from hatch_aoti.worker.structural import replaced

_CONV = {
    torch.ops.aten.conv1d.default,
    torch.ops.aten.conv2d.default,
    torch.ops.aten.conv3d.default,
    torch.ops.aten.convolution.default,
}
_NORM = {torch.ops.aten.batch_norm.default, torch.ops.aten._native_batch_norm_legit_no_training.default}
#: torch's convolution layers (the precision variants' too).
CONV_LAYERS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def folded_batch_norms(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any
) -> tuple[torch.nn.Module, int]:
    """``module`` with each batch norm that only a convolution feeds folded into it, and how many were:
    a copy of the modules on the way to them (the rest shared), or ``module`` itself where none is."""
    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return module, 0
    with torch.no_grad():
        program = torch.export.export(module, tuple(args), dict(kwargs), dynamic_shapes=dynamic_shapes)
    swaps: dict[int, torch.nn.Module] = {}
    for conv_name, norm_name in pairs(program.graph, module):
        conv, norm = module.get_submodule(conv_name), module.get_submodule(norm_name)
        swaps[id(conv)] = torch.nn.utils.fusion.fuse_conv_bn_eval(conv, norm)  # type: ignore[arg-type,type-var]
        swaps[id(norm)] = torch.nn.Identity()
    return replaced(module, swaps), len(swaps) // 2


def pairs(graph: torch.fx.Graph, module: torch.nn.Module) -> list[tuple[str, str]]:
    """(convolution, batch norm) module names where the graph calls each once, in eval mode, and the norm
    is the only reader of the convolution's output."""
    calls = collections.Counter(
        _owner(node) for node in graph.nodes if node.op == "call_function" and node.target is not operator.getitem
    )
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _NORM:
            continue
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or source.target not in _CONV or len(source.users) != 1:
            continue
        conv_name, norm_name = _owner(source), _owner(node)
        if not conv_name or not norm_name or calls[conv_name] != 1 or calls[norm_name] != 1:
            continue
        try:
            conv, norm = module.get_submodule(conv_name), module.get_submodule(norm_name)
        except AttributeError:
            continue
        if _foldable(conv, norm):
            found.append((conv_name, norm_name))
    return found


def _owner(node: torch.fx.Node) -> str | None:
    """The name of the innermost module whose ``forward`` made the node, as export recorded it."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else None


def _foldable(conv: torch.nn.Module, norm: torch.nn.Module) -> bool:
    """Only a float32 convolution of torch's own and a norm with running statistics, both in eval mode:
    what ``fuse_conv_bn_eval`` folds exactly."""
    return (
        type(conv) in CONV_LAYERS
        and isinstance(norm, torch.nn.modules.batchnorm._BatchNorm)
        and not conv.training
        and not norm.training
        and norm.running_mean is not None
        and norm.running_var is not None
        and conv.weight.dtype == torch.float32
    )
