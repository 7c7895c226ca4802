"""What an exported program says of its model: the size of its weights, whether they can ship packed,
how much work its products by a weight do, how many convolutions it has.

Learned once a model is exported, and given explicitly to whoever decides by it (the backend's
settings, the compile request); ``weights = "auto"`` is resolved by the size found here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from hatch_aoti.backends.interface import ProgramFacts
from hatch_aoti.settings.spec import ModelSpec


def program_facts(exported: Any) -> ProgramFacts:
    """What the exported program says of its weights, its products by them and its convolutions."""
    products = product_macs(exported)
    return ProgramFacts(
        weights_bytes=weights_size(exported),
        repackable=repackable(exported),
        weighted_macs=mean_macs(products),
        weighted_products=len(products),
        convolutions=convolutions(exported),
    )


def resolved_weights(spec: ModelSpec, facts: ProgramFacts) -> ModelSpec:
    """The spec with ``weights = "auto"`` resolved by the size of the weights."""
    if spec.weights != "auto":
        return spec
    return dataclasses.replace(spec, weights=auto_weights(spec, facts.weights_bytes or 0))


#: ``weights = "auto"``: mapped from this size; below it, the library keeps them (one file,
#: the standard ``.pt2`` from ``save_pt2()``), and the copy they cost at load is small.
AUTO_MAPPED_FROM = 32 * 2**20


def auto_weights(spec: ModelSpec, size: int) -> str:
    return "mapped" if spec.device == "cpu" and size >= AUTO_MAPPED_FROM else "embedded"


def repackable(exported: Any) -> bool:
    """Whether the weights Inductor packs for oneDNN can ship as the dense tensors they come from:
    not those of transposed convolutions (packed with their channels swapped)."""
    import torch

    for node in exported.graph.nodes:
        name = str(node.target)
        if "conv_transpose" in name:
            return False
        if node.target is torch.ops.aten.convolution.default and len(node.args) > 6 and node.args[6]:
            return False
    return True


def weighted_macs(exported: Any) -> int | None:
    """Mean multiply-adds of the program's matrix products by a weight (the products Inductor can
    pack), sizes that vary taken at their example's; None where it has none."""
    return mean_macs(product_macs(exported))


def mean_macs(counts: list[int]) -> int | None:
    """The mean of ``product_macs``; None where there are none."""
    return sum(counts) // len(counts) if counts else None


def product_macs(exported: Any) -> list[int]:
    """Multiply-adds of each of the program's matrix products by a weight. Products by a weight that is
    first reshaped or expanded (``einsum``, ``bmm``) are not counted, nor one whose size has no example."""
    import torch

    aten = torch.ops.aten
    #: where each op takes its weight, and the weight's dimension its output's elements sum over
    weight_at: dict[Any, tuple[int, int]] = {aten.linear.default: (1, 1), aten.mm.default: (1, 0)}
    weight_at |= {aten.addmm.default: (2, 0), aten.matmul.default: (1, -2)}
    weights = _weight_names(exported)
    counts = []
    for node in exported.graph.nodes:
        at, inner = weight_at.get(node.target, (None, 0))
        if at is None or len(node.args) <= at or getattr(node.args[at], "name", None) not in weights:
            continue
        out, weight = node.meta.get("val"), node.args[at].meta.get("val")
        with contextlib.suppress(Exception):  # a size without an example
            counts.append(_example(out.numel()) * _example(weight.shape[inner]))
    return counts


def convolutions(exported: Any) -> int:
    """How many convolutions by a weight the program has: oneDNN runs those packed or not, so packing
    their weights once saves a reorder per call at any size."""
    import torch

    aten = torch.ops.aten
    ops = {aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d}  # every overload: padding="same" too
    weights = _weight_names(exported)
    return sum(_convolution_weight(n, ops) in weights for n in exported.graph.nodes)


def _convolution_weight(node: Any, ops: set[Any]) -> str | None:
    """The name of the weight a convolution node convolves by, or None for any other node."""
    if getattr(node.target, "_overloadpacket", None) not in ops or len(node.args) < 2:
        return None
    return getattr(node.args[1], "name", None)


def _weight_names(exported: Any) -> set[str]:
    """The graph inputs that hold the program's weights (parameters, buffers, constants)."""
    signature = exported.graph_signature
    weights = {*signature.inputs_to_parameters, *signature.inputs_to_buffers}
    return weights | set(signature.inputs_to_lifted_tensor_constants)


def _example(size: Any) -> int:
    """A size, or a symbolic one's value in the example it was traced with."""
    return size if isinstance(size, int) else int(size.node.hint)


def weights_size(exported: Any) -> int:
    """Bytes of an exported program's weights and constants."""
    import torch

    total = 0
    for tensor in [*exported.state_dict.values(), *exported.constants.values()]:
        with contextlib.suppress(Exception):  # tensor subclasses may have no storage of their own
            total += tensor.untyped_storage().nbytes() if isinstance(tensor, torch.Tensor) else 0
    return total
