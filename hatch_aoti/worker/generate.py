"""The one generator of synthetic inputs.

The build verifies declared inputs with it, and ``hatch-aoti verify`` remakes them with it
from the manifest (the leaves, each tried case's sizes and seed), so both run the same tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hatch_aoti.settings.constants import INTEGER_DEFAULTS


def generator(seed: int) -> torch.Generator:
    """A fresh CPU generator: each input set starts from its own seed."""
    return torch.Generator().manual_seed(seed)


def tensor(
    shape: Sequence[int],
    dtype: str,
    device: str,
    gen: torch.Generator,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Random values of ``dtype``: normals for floats (uniform in ``[low, high)`` where given), integers
    in ``[low, high)`` (default ``[0, 100)``, which index and embedding inputs of 100+ entries take),
    true/false for bools."""
    kind = getattr(torch, dtype)
    if kind == torch.bool:
        out = torch.randint(0, 2, list(shape), generator=gen).bool()
    elif kind.is_floating_point or kind.is_complex:
        if low is not None or high is not None:
            start = low if low is not None else 0.0
            stop = high if high is not None else start + 1.0
            out = torch.rand(list(shape), generator=gen, dtype=torch.float64) * (stop - start) + start
        else:
            out = torch.randn(list(shape), generator=gen, dtype=torch.float64)
        out = out.to(kind)
    else:
        info = torch.iinfo(kind)
        start = int(low) if low is not None else max(INTEGER_DEFAULTS[0], info.min)
        stop = int(high) if high is not None else min(INTEGER_DEFAULTS[1], info.max)
        out = torch.randint(start, stop, list(shape), generator=gen, dtype=torch.int64).to(kind)
    return out.to(device)
