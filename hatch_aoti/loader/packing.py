"""Weights packed into oneDNN's layouts for this CPU as a model loads: the wheel ships them dense."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from .schema import Entry, Packing

#: Which of the weights the build recorded the loader packs into oneDNN's layouts for this CPU
#: (``HATCH_AOTI_PACK``): the convolutions' by default, which oneDNN would otherwise reorder on every
#: call; ``all`` adds the linear layers', whose packed copies are each process's own (not shared, as
#: the mapped weights are) and run a few percent faster on some CPUs; ``none`` packs nothing.
PACK_VARIABLE = "HATCH_AOTI_PACK"


CHOICES: dict[str, frozenset[str] | None] = {
    "convolutions": frozenset({"mkldnn::_reorder_convolution_weight"}),
    "all": None,
    "none": frozenset(),
}


def pack_ops() -> frozenset[str] | None:
    """The packing ops ``HATCH_AOTI_PACK`` lets the loader run (None: every one)."""
    text = os.environ.get(PACK_VARIABLE, "").strip() or "convolutions"
    if text not in CHOICES:
        raise ValueError(f"{PACK_VARIABLE}={text!r}: expected one of {', '.join(CHOICES)}")
    return CHOICES[text]


def chosen(entry: Entry) -> dict[str, Packing]:
    """The weights of a model packed as it loads here, by constant name: each one's packing op and arguments."""
    ops = pack_ops()
    recorded = entry.get("packing", {})
    return {c: how for c, how in recorded.items() if ops is None or how["op"] in ops}


def packed(torch: Any, name: str, packing: dict[str, Any], dense: Callable[[], tuple[Any, Any]]) -> dict[str, Any]:
    """The weights of ``packing`` packed into oneDNN's layouts for this CPU, by constant name: the wheel
    ships them dense. A torch that cannot pack them runs them dense, with a warning."""
    try:
        weights, _owner = dense()  # the owner keeps them alive while they are packed
        return {constant: op(torch, how["op"])(weights[constant], *how["args"]) for constant, how in packing.items()}
    except Exception as exc:  # the dense weights run everywhere, only slower
        warnings.warn(
            f"compiled model {name!r}: torch {torch.__version__} could not pack its weights for this CPU "
            f"({type(exc).__name__}: {exc}); they run dense, convolutions reordered on every call",
            RuntimeWarning,
            stacklevel=4,
        )
        return {}


def op(torch: Any, qualified: str) -> Any:
    """``namespace::name`` as torch's operator."""
    namespace, _, op = qualified.partition("::")
    return getattr(getattr(torch.ops, namespace), op)
