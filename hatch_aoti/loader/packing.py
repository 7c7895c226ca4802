"""Weights packed into oneDNN's layouts for this CPU as a model loads: the wheel ships them dense."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from .schema import Entry, Packing

#: Which of the weights the build recorded the loader packs into oneDNN's layouts for this CPU
#: (``HATCH_AOTI_PACK``): the convolutions' by default, which oneDNN would otherwise reorder on every
#: call; ``all`` adds the linear layers', whose packed copies are each process's own (not shared, as
#: the mapped weights are) and run a few percent faster on some CPUs; ``none`` packs nothing that
#: runs without it. int8 weights are always packed: oneDNN's int8 kernels take no other.
PACK_VARIABLE = "HATCH_AOTI_PACK"


class Op(NamedTuple):
    """A packing op a manifest may name: whether the model runs without it (dense), and whether the
    wheel ships the weight transposed, in the packed tensor's shape (the op takes it the other way)."""

    required: bool
    transposed: bool = False


#: The packing ops the loader runs, and nothing else a manifest names.
OPS = {
    "mkldnn::_reorder_convolution_weight": Op(required=False),
    "mkldnn::_reorder_linear_weight": Op(required=False),
    "onednn::qlinear_prepack": Op(required=True, transposed=True),
    "onednn::qconv_prepack": Op(required=True),
}

CHOICES: dict[str, frozenset[str] | None] = {
    "convolutions": frozenset({"mkldnn::_reorder_convolution_weight"}),
    "all": None,
    "none": frozenset(),
}


def pack_ops() -> frozenset[str] | None:
    """The optional packing ops ``HATCH_AOTI_PACK`` lets the loader run (None: every one)."""
    text = os.environ.get(PACK_VARIABLE, "").strip() or "convolutions"
    if text not in CHOICES:
        raise ValueError(f"{PACK_VARIABLE}={text!r}: expected one of {', '.join(CHOICES)}")
    return CHOICES[text]


def chosen(entry: Entry) -> dict[str, Packing]:
    """The weights of a model packed as it loads here, by constant name: each one's packing op and arguments."""
    ops = pack_ops()
    recorded = entry.get("packing", {})
    return {c: how for c, how in recorded.items() if ops is None or how["op"] in ops or required(how)}


def required(how: Packing) -> bool:
    """Whether the model cannot run without this packing (an op the loader does not know: it cannot)."""
    return OPS.get(how["op"], Op(required=True)).required


def packed(torch: Any, name: str, packing: dict[str, Any], dense: Callable[[], tuple[Any, Any]]) -> dict[str, Any]:
    """The weights of ``packing`` packed into oneDNN's layouts for this CPU, by constant name: the wheel
    ships them dense. A torch that cannot pack the optional ones runs them dense, with a warning; one
    that cannot pack a required one cannot run the model."""
    try:
        weights, _owner = dense()  # the owner keeps them alive while they are packed
    except Exception as exc:
        _cannot_pack(torch, name, "its weights", exc, needed=any(map(required, packing.values())))
        return {}
    found = {}
    for constant, how in sorted(packing.items(), key=lambda item: not required(item[1])):
        try:
            found[constant] = replay(torch, how, weights[constant], weights)
        except Exception as exc:
            _cannot_pack(torch, name, f"its weight {constant} ({how['op']})", exc, needed=required(how))
            return {c: t for c, t in found.items() if required(packing[c])}
    return found


def _cannot_pack(torch: Any, name: str, what: str, exc: Exception, *, needed: bool) -> None:
    """An error where the model runs only packed; else a warning, and the weights run dense."""
    if needed:
        raise RuntimeError(
            f"compiled model {name!r}: torch {torch.__version__} could not pack {what} for this CPU "
            f"({type(exc).__name__}: {exc}), and it runs only packed"
        ) from None
    warnings.warn(  # the dense weights run everywhere, only slower
        f"compiled model {name!r}: torch {torch.__version__} could not pack its weights for this CPU "
        f"({type(exc).__name__}: {exc}); they run dense, convolutions reordered on every call",
        RuntimeWarning,
        stacklevel=5,
    )


#: The dtypes of the small tensors a packing's arguments hold by value, and how many values at most.
VALUE_DTYPES = ("float32", "float64", "int32", "int64")
BY_VALUE = 64


def replay(torch: Any, how: Packing, weight: Any, weights: dict[str, Any]) -> Any:
    """One weight packed as the build recorded it; an argument ``{"constant": name}`` is that constant,
    ``{"values": [...], "dtype": ...}`` a small tensor of those values."""
    if how["op"] not in OPS:
        raise ValueError(f"{how['op']} is not a packing op this loader runs")
    namespace, _, op = how["op"].partition("::")
    if OPS[how["op"]].transposed:
        weight = weight.t().contiguous()
    return getattr(getattr(torch.ops, namespace), op)(weight, *[_argument(torch, a, weights) for a in how["args"]])


def _argument(torch: Any, arg: Any, weights: dict[str, Any]) -> Any:
    if not isinstance(arg, dict):
        return arg
    if "constant" in arg:
        return weights[arg["constant"]]
    if arg.get("dtype") not in VALUE_DTYPES:
        raise ValueError(f"a packing argument of dtype {arg.get('dtype')!r}")
    return torch.tensor(arg["values"], dtype=getattr(torch, arg["dtype"]))


def runs_dense(entry: Entry) -> bool:
    """Whether torch's own runner, which packs nothing, can run the library on its shipped weights."""
    return not any(required(how) for how in entry.get("packing", {}).values())
