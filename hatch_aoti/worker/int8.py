"""The int8 program of a model: its weights in int8, made with torchao's PT2E flow for x86 Inductor.

Linear layers are quantized dynamically (int8 weights per output channel, activations quantized per
call), 2-D convolutions (those torchao's X86InductorQuantizer takes) statically: activations quantized
with ranges calibrated on the model's ``calibration`` samples; without samples they are left as they
are (:func:`hatch_aoti.worker.precision.export` gives them the next variant's precision).
transformers' ``Conv1D`` (GPT-2's layers: an ``addmm`` with a transposed weight) is a linear layer
too: the program is exported from a structural copy of the module in which each is an ``nn.Linear``
whose weight is a transposed view of the ``Conv1D``'s own, so that the quantizer takes it, while the
module itself (the float32 reference that verification runs) stays as it was and no weight is copied.
A GELU written out in its tanh form (GPT-2's too) becomes the one op it computes, which Inductor
fuses into the int8 product before it.

The program compiles to oneDNN's int8 kernels where Inductor freezes it (``freezing``, under
``torch.no_grad()``) in a process where torchao's x86 lowering passes are registered: importing its
quantizer registers them, process-wide, as :func:`int8_program` does, and they pack the int8 weights
for oneDNN whatever ``cpp.weight_prepack`` says. With it, the build ships them dense and records the
packing for the loader (``loader.packing.OPS``), as for float32 weights. A process that loads or
compiles a saved int8 program it did not make calls :func:`register_lowering` first: without it the
program's quantize ops cannot be loaded.

torchao is a build-time requirement of the projects that ask for int8 only: it is imported here when
a program is made, never by the rest of the worker.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from hatch_aoti.worker.smoothing import smoothed
from hatch_aoti.worker.structural import replaced

INSTALL = (
    "int8 precision quantizes the model with torchao at build time: add `torchao` to `build-system.requires` "
    "(with the torch there) in pyproject.toml"
)

#: The module whose import registers torchao's quantize ops and its x86 Inductor lowering passes.
LOWERING = "torchao.quantization.pt2e.quantizer.x86_inductor_quantizer"

_DEQUANTIZE = {"dequantize_per_channel", "dequantize_per_tensor"}
_LINEAR = {torch.ops.aten.linear.default}
_CONV = {
    torch.ops.aten.conv1d.default,
    torch.ops.aten.conv2d.default,
    torch.ops.aten.conv3d.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten.conv_transpose1d.default,
    torch.ops.aten.conv_transpose2d.input,
    torch.ops.aten.conv_transpose3d.input,
}


@dataclass(frozen=True)
class Quantized:
    """What an int8 program quantized: (quantized, total) of its layers, as called in its graph."""

    linear: tuple[int, int]
    """Linear layers, transformers' ``Conv1D`` included."""
    conv: tuple[int, int]
    calibrated: bool
    """Whether calibration samples were given (without them, convolutions are not quantized)."""
    rest: str = "float32"
    """What the convolutions that are not quantized compute in."""
    smoothed: int = 0
    """How many linear layers were smoothed before they were quantized (:mod:`.smoothing`)."""

    def describe(self) -> str:
        """``int8: 73 of 73 linear layers (73 smoothed), 0 of 53 convolutions (no `calibration`)``"""
        linear = f"{self.linear[0]} of {self.linear[1]} linear layer{'s' if self.linear[1] != 1 else ''}"
        linear += f" ({self.smoothed} smoothed)" if self.smoothed else ""
        conv = f"{self.conv[0]} of {self.conv[1]} convolution{'s' if self.conv[1] != 1 else ''}"
        why = " (calibrated)" if self.calibrated else " (no `calibration`)" if self.conv[1] else ""
        if self.rest != "float32":
            why = f"{why[:-1]}: the others compute in {self.rest}, as the next variant does)"
        return f"int8: {linear}, {conv}{why}"


def int8_program(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_shapes: Any,
    calibration: list[tuple[tuple[Any, ...], dict[str, Any]]] | None,
    *,
    reduce_range: bool = False,
    rest: torch.dtype = torch.float32,
) -> tuple[torch.export.ExportedProgram, Quantized]:
    """The model with int8 weights, exported: ready for ``torch._inductor.aoti_compile_and_package``
    (with freezing, which fuses the quantized patterns into int8 kernels).

    ``args``, ``kwargs`` and ``dynamic_shapes`` are those the float32 program was exported with;
    ``calibration`` the samples (each ``(args, kwargs)``) that set the convolutions' activation ranges;
    ``rest`` what the convolutions left unquantized compute in (their weights in it, cast in and out).
    ``module`` is left as it was: its parameters are the same objects, with the same values.
    """
    prepare_pt2e, convert_pt2e, quantizer = _torchao(calibrated=bool(calibration), reduce_range=reduce_range)
    samples = calibration or [(args, kwargs)]
    linear_layers, smoothed_layers = smoothed(_linear_conv1d(module), samples)
    with torch.no_grad():
        graph = torch.export.export(linear_layers, tuple(args), dict(kwargs), dynamic_shapes=dynamic_shapes).module()
        graph.graph.eliminate_dead_code()  # an unused output (BERT's pooler) is a layer with no output to annotate
        _tanh_gelus(graph)
        prepared = prepare_pt2e(graph, quantizer)
        for sample_args, sample_kwargs in samples:  # the weights' observers need one
            prepared(*sample_args, **sample_kwargs)
        converted = convert_pt2e(prepared)
        cast = _convolutions_in(converted, rest) if rest != torch.float32 else 0
        _drop_unused_weights(converted)
        _contiguous_int8_weights(converted)
        program = torch.export.export(converted, tuple(args), dict(kwargs), dynamic_shapes=dynamic_shapes)
    linear, conv = _count(program.graph, _LINEAR), _count(program.graph, _CONV)
    rest_name = str(rest).removeprefix("torch.") if cast else "float32"
    return program, Quantized(linear, conv, bool(calibration), rest_name, smoothed_layers)


def register_lowering() -> None:
    """Make this process able to load and compile int8 programs: torchao's quantize ops, and its x86
    Inductor passes that fuse their patterns into oneDNN int8 kernels as the program is frozen. Importing
    torchao's X86InductorQuantizer registers both, once per process, and sets Inductor's
    ``pre_grad_custom_pass`` (torchao's ``quant_lift_up``); this is that import, with a clear error
    where torchao is missing."""
    _torchao(calibrated=False)


def _torchao(*, calibrated: bool, reduce_range: bool = False) -> tuple[Any, Any, Any]:
    """``prepare_pt2e``, ``convert_pt2e`` and the quantizer: linear layers dynamic, convolutions static
    where calibrated. One X86InductorQuantizer takes one mode only, so each mode has its own. Activations
    take the full uint8 range, which CPUs with VNNI multiply without saturating, or 7 bits with
    ``reduce_range``, which any CPU does."""
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer.composable_quantizer import ComposableQuantizer
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )
    except ImportError as exc:
        if importlib.util.find_spec("torchao") is None:
            raise ImportError(INSTALL, name="torchao") from None
        raise ImportError(
            f"int8 precision needs torchao's PT2E quantization (torchao 0.18 or later), which the installed "
            f"torchao lacks ({exc}): require `torchao>=0.18` in `build-system.requires`",
            name="torchao",
        ) from exc
    linear = X86InductorQuantizer().set_module_type_qconfig(
        torch.nn.Linear,
        get_default_x86_inductor_quantization_config(is_dynamic=True, reduce_range=reduce_range),
    )
    quantizers = [linear]
    if calibrated:
        conv = X86InductorQuantizer().set_module_type_qconfig(
            torch.nn.Conv2d,
            get_default_x86_inductor_quantization_config(is_dynamic=False, reduce_range=reduce_range),
        )
        quantizers.append(conv)
    return prepare_pt2e, convert_pt2e, ComposableQuantizer(quantizers)


def _linear_conv1d(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with each transformers ``Conv1D`` as an ``nn.Linear`` sharing its weight (transposed) and
    bias: a structural copy, every parameter shared. ``module`` itself where it has no ``Conv1D``."""
    found = sys.modules.get("transformers.pytorch_utils")  # a model that has one has imported it
    conv1d = getattr(found, "Conv1D", None)
    if conv1d is None:
        return module
    return replaced(module, {id(m): _as_linear(m) for m in module.modules() if isinstance(m, conv1d)})


def _as_linear(conv1d: torch.nn.Module) -> torch.nn.Linear:
    """``Conv1D(x) = x @ weight + bias``, with ``weight`` of shape (in, out): ``nn.Linear`` on ``weight.T``."""
    weight = conv1d.weight
    assert isinstance(weight, torch.Tensor)
    bias = conv1d.bias
    linear = torch.nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight.detach().t(), requires_grad=weight.requires_grad)  # a view
    if bias is not None:
        linear.bias = bias  # type: ignore[assignment]
    return linear


def _written_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation as transformers writes it out (``gelu_new``: GPT-2, GPT-J, CodeGen, Phi)."""
    return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu.default(x, approximate="tanh")


def _tanh_gelus(graph: torch.fx.GraphModule) -> int:
    """Turn each GELU written out as :func:`_written_gelu`, of a floating-point tensor, into the one op it
    computes, ``aten.gelu`` with ``approximate="tanh"``, which Inductor runs inside the int8 product
    before it as a oneDNN post-op, where the written one takes a kernel of its own (figures:
    docs/performance.md#precision-variants). How many it turned; the graph is recompiled."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.subgraph_rewriter import replace_pattern_with_filters

    def floating(match: Any, original: torch.fx.Graph, pattern: torch.fx.Graph) -> bool:
        value = match.placeholder_nodes[0].meta.get("val")
        return isinstance(value, torch.Tensor) and value.is_floating_point()

    x = torch.empty(1)
    turned = replace_pattern_with_filters(graph, make_fx(_written_gelu)(x), make_fx(_gelu)(x), [floating])
    for match in turned:
        for node in match.replacements:  # the quantizer reads what each node computes, and where it comes from
            node.meta = dict(match.nodes_map[match.anchor].meta)
    return len(turned)


def _convolutions_in(graph: torch.fx.GraphModule, dtype: torch.dtype) -> int:
    """Each convolution of the converted graph that was not quantized computing in ``dtype``: its input
    cast, its weight and bias copies in ``dtype`` (the module's own are left as they are), its output
    cast back. Done on the converted graph, since the quantizer refuses a convolution whose module
    ends in a cast. How many there were."""
    count = 0
    for node in list(graph.graph.nodes):
        weight = node.args[1] if node.op == "call_function" and node.target in _CONV else None
        if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":  # a quantized one's is dequantized
            continue
        bias = node.args[2] if len(node.args) > 2 else None
        with graph.graph.inserting_before(node):
            x = graph.graph.call_function(torch.ops.aten.to.dtype, (node.args[0], dtype))
            copies = [_copy_in(graph, n, dtype) if isinstance(n, torch.fx.Node) else n for n in (weight, bias)]
        node.args = (x, *copies, *node.args[3:])
        with graph.graph.inserting_after(node):
            back = graph.graph.call_function(torch.ops.aten.to.dtype, (node, torch.float32))
        node.replace_all_uses_with(back, delete_user_cb=lambda user, cast=back: user is not cast)
        count += 1
    graph.recompile()
    return count


def _copy_in(graph: torch.fx.GraphModule, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """A ``get_attr`` of a copy in ``dtype`` of the tensor ``node`` reads, held by the graph module."""
    owner_name, _, attr = str(node.target).rpartition(".")
    value = getattr(graph.get_submodule(owner_name), attr)
    name = f"{str(node.target).replace('.', '_')}_{str(dtype).removeprefix('torch.')}"
    graph.register_buffer(name, value.detach().to(dtype))
    return graph.graph.get_attr(name)


def _drop_unused_weights(graph: torch.fx.GraphModule) -> None:
    """Take out of the converted module the parameters and buffers its graph no longer reads: the float32
    weights that int8 ones replaced, which would otherwise be exported (and shipped) beside them. Only
    the converted module's own containers change: the parameters are the caller's module's objects."""
    for node in [node for node in graph.graph.nodes if node.op == "get_attr" and not node.users]:
        graph.graph.erase_node(node)
    graph.recompile()
    read = {str(node.target) for node in graph.graph.nodes if node.op == "get_attr"}
    named = [*graph.named_parameters(remove_duplicate=False), *graph.named_buffers(remove_duplicate=False)]
    for name, _ in named:
        if name in read:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = graph.get_submodule(owner_name)
        owner._parameters.pop(attr, None)
        owner._buffers.pop(attr, None)


def _contiguous_int8_weights(graph: torch.fx.GraphModule) -> None:
    """Lay the int8 weights out contiguously. Quantizing keeps a weight's strides, and a ``Conv1D``'s
    weight is a transposed view: Inductor's freezing packs such an int8 weight for oneDNN as if it were
    contiguous (torch 2.13, torchao 0.18), and the compiled model's outputs are then wrong (GPT-2:
    cosine 0 against eager). The int8 weights are the converted module's own, a quarter of the float32
    ones' size; the copy replaces the strided one."""
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_name, _, attr = str(node.target).rpartition(".")
        owner = graph.get_submodule(owner_name)
        value = getattr(owner, attr)
        if not isinstance(value, torch.Tensor) or value.dtype is not torch.int8 or value.is_contiguous():
            continue
        value = value.contiguous()
        if attr in owner._parameters:
            owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
        elif attr in owner._buffers:
            owner._buffers[attr] = value
        else:
            setattr(owner, attr, value)


def _count(graph: torch.fx.Graph, ops: set[Any]) -> tuple[int, int]:
    """(quantized, total) of the calls to ``ops``: quantized where the weight is dequantized from int8."""
    calls = [node for node in graph.nodes if node.op == "call_function" and node.target in ops]
    return sum(_int8_weight(node) for node in calls), len(calls)


def _int8_weight(node: torch.fx.Node) -> bool:
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if not isinstance(weight, torch.fx.Node) or weight.op != "call_function":
        return False
    target = getattr(weight.target, "_opname", getattr(weight.target, "__name__", ""))
    if target not in _DEQUANTIZE:
        return False
    source = weight.args[0]
    return isinstance(source, torch.fx.Node) and source.meta.get("val") is not None and _is_int8(source)


def _is_int8(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype is torch.int8
