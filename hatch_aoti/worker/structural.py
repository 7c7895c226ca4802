"""Structural copies of a module: some of its submodules swapped, everything else shared.

A lower-precision variant is exported from such a copy (batch norms folded into convolutions, GPT-2's
``Conv1D`` as ``nn.Linear``, smoothed linear layers), so the module itself stays the float32 variant
and the reference that verification runs, and no weight is copied that is not changed.
"""

from __future__ import annotations

import copy

import torch


def replaced(module: torch.nn.Module, swaps: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """``module`` with each submodule whose ``id`` is in ``swaps`` replaced, wherever it is used: each module
    on the way to one copied (its own dict of submodules; parameters, buffers and hooks shared), the
    others shared. ``module`` itself where nothing is swapped."""
    made: dict[int, torch.nn.Module] = {}

    def walk(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) in made:  # a module used in two places stays one module
            return made[id(m)]
        new = swaps.get(id(m), m)
        if new is m:
            children = {name: walk(child) for name, child in m._modules.items() if child is not None}
            changed = {name: child for name, child in children.items() if child is not m._modules[name]}
            if changed:
                new = copy.copy(m)
                new._modules = {**m._modules, **changed}
        made[id(m)] = new
        return new

    return walk(module) if swaps else module
