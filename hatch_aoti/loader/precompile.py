"""The precompile backend's run time: the model's module, built by its factory, under the functions
the build saved. Imported only for precompile models (the Python and torch that made them are
checked by :func:`.host.problems` first)."""

from __future__ import annotations

import os
import threading
from typing import Any

from .inputs import tensor_check, write_back
from .schema import Entry, Leaf, Region
from .specs import children, treespec


def call(module: Any, *args: Any, **kwargs: Any) -> Any:
    """What the precompile backend compiles: the model's module called with its inputs.

    It lives in the loader, which ships with every wheel, because a precompiled artifact
    refers to the function it was compiled from by module and name.
    """
    return module(*args, **kwargs)


class Precompiled:
    """The saved functions of a precompile model, one per region of sizes (each compiled under its own
    region's guards); the first is loaded with the model, the others on first use."""

    def __init__(self, torch: Any, name: str, entry: Entry, directory: str) -> None:
        import pkgutil

        import torch._inductor.config

        factory = pkgutil.resolve_name(entry["factory"])
        self.torch, self.name, self.directory = torch, name, directory
        # The module and the guards are made outside inference mode, which would give the
        # parameters other dispatch keys than the guards expect; the kernels are compiled when
        # loaded, with the settings their code was generated for (another vector width computes garbage).
        self.settings = torch._inductor.config.patch(entry["inductor_configs"])
        with torch.inference_mode(False):
            self.module = factory().to(entry["device"]).eval()
        self.regions: list[Region] = entry.get("regions") or [{"file": entry["file"], "sha256": "", "dims": {}}]
        self.loaded: list[Any] = [None] * len(self.regions)
        self.lock = threading.Lock()
        self.axes = _root_axes(torch, entry["call"])
        leaves = entry["call"]
        self.tensor_index = [i for i, leaf in enumerate(leaves) if "const" not in leaf]
        self.mutated = [p for p, i in enumerate(self.tensor_index) if leaves[i].get("mutated")]
        self.in_spec = treespec(torch.utils._pytree, name, entry["call_spec"][0])
        self.kwarg_names = tuple(children(self.in_spec)[1].context)
        self._load(0)

    def _load(self, index: int) -> None:
        path = os.path.join(self.directory, self.regions[index]["file"])
        with self.torch.inference_mode(False), self.settings, open(path, "rb") as f:
            self.loaded[index] = self.torch.compiler.load_compiled_function(f)

    def _compiled_for(self, tensors: list[Any]) -> Any:
        sizes = {root: (tensors[p].shape[axis] - offset) // mult for p, axis, root, mult, offset in self.axes}
        index = next(
            (
                i
                for i, region in enumerate(self.regions)
                if all(
                    low <= sizes[r] and (high is None or sizes[r] <= high) for r, (low, high) in region["dims"].items()
                )
            ),
            None,
        )
        if index is None:
            raise ValueError(f"compiled model {self.name!r}: no compiled region covers sizes {sizes}")
        if self.loaded[index] is None:
            with self.lock:
                if self.loaded[index] is None:
                    self._load(index)
        return self.loaded[index]

    def _plain(self, tensor: Any) -> Any:  # contiguous, as when it was compiled: the guards check strides
        if tensor.is_inference():
            return tensor.clone(memory_format=self.torch.contiguous_format)
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def __call__(self, tensors: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        torch, compiled = self.torch, self._compiled_for(tensors)
        leaves = self.in_spec.flatten_up_to((args, {k: kwargs[k] for k in self.kwarg_names}))  # checked already
        # Its guards were recorded under no_grad, outside inference mode: inside it, and for
        # tensors made in it, they would fail.
        with torch.inference_mode(False), torch.no_grad():
            copies = [self._plain(t) for t in tensors]
            for index, copy in zip(self.tensor_index, copies):
                leaves[index] = copy
            args, kwargs = torch.utils._pytree.tree_unflatten(leaves, self.in_spec)
            try:
                out = compiled(self.module, *args, **kwargs)
            except RuntimeError as exc:
                if not str(exc).startswith("GuardManager check failed"):
                    raise
                why = " ".join(str(exc).split())[:400]
                raise ValueError(
                    f"compiled model {self.name!r}: these inputs fail the guards it was compiled with: {why}"
                ) from None
        write_back(tensors, copies, self.mutated)  # in the caller's mode, as eager writes
        return out


def _root_axes(torch: Any, leaves: list[Leaf]) -> list[tuple[int, int, str, int, int]]:
    """(tensor position, axis, root dim, multiple, offset) of every dynamic axis of a model's inputs."""
    checks = [tensor_check(torch, leaf) for leaf in leaves if "const" not in leaf]
    return [
        (position, axis, root, mult, offset)
        for position, (_, _, _, dims) in enumerate(checks)
        for axis, _, _, root, mult, offset in dims
    ]
