"""One model as it loads: its checks against this host, its runner, and the slow paths of a call."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from .host import check_symbols, damaged, problems
from .inputs import describe, exported_layout, fits, tensor_check, unsafe_writes
from .packing import chosen, packed, required, runs_dense
from .runtime import opened
from .schema import Entry, Output, Parameter, folder_of, precision_of
from .specs import children, treespec
from .weights import mapped


class Model:
    """One loaded model: the runner, its call specs and the slow paths of a call.

    Calls are checked (number and structure of inputs, dtype, device, rank, sizes and
    dynamic ranges) before they reach the compiled code, which would otherwise abort
    or silently compute garbage on a wrong input.
    """

    runner: Any
    run: Callable[..., Any]
    weights: dict[str, Any] | None

    def __init__(self, name: str, entry: Entry, artifacts: str, built_with: str) -> None:
        """``artifacts``: the package's ``_aoti`` folder; ``built_with``: the torch the wheel was built with."""
        import torch
        from torch.utils import _pytree as pytree

        self.precision = precision_of(entry)
        self.name, self.directory, self.built_with = name, os.path.join(artifacts, folder_of(name, entry)), built_with
        self.device = entry["device"]
        problem = next(iter(problems(entry, torch)), None) or damaged(entry, self.directory)
        if problem:
            raise RuntimeError(f"compiled model {name!r} {problem}")
        self.file = os.path.join(self.directory, entry["file"])
        self.weights = None
        self.backend = entry.get("backend", "aoti")
        if self.backend == "aoti":
            in_spec, out_spec = self._aoti(torch, entry)
        else:  # other backends return the model's own output structure
            self.runner = None
            if self.backend == "precompile":
                from .precompile import Precompiled

                self.run = Precompiled(torch, name, entry, self.directory)
            else:
                self.run = backend_runtime(name, entry, artifacts)  # float32 only: the build refuses others
            in_spec, out_spec = entry["call_spec"]
        self.pytree = pytree
        self.tensor = torch.Tensor
        self.strided = torch.strided
        self.in_spec = treespec(pytree, name, in_spec)
        self.out_spec = treespec(pytree, name, out_spec)
        args_spec, kwargs_spec = children(self.in_spec)
        self.n_args = args_spec.num_children
        self.kwarg_names = tuple(kwargs_spec.context)

        leaves = self.leaves = entry["call"]
        self.constants = [(i, leaf["const"]) for i, leaf in enumerate(leaves) if leaf.get("check_const")]
        self.tensor_index = [i for i, leaf in enumerate(leaves) if "const" not in leaf]
        tensors = [leaves[i] for i in self.tensor_index]
        self.checks = [tensor_check(torch, leaf) for leaf in tensors]
        self.mutated = [i for i, leaf in enumerate(tensors) if leaf.get("mutated")]
        self.complex = any(dtype.is_complex for dtype, _, _, _ in self.checks)
        # row indices into a table: out of range, the kernel's bounds check would end the process
        self.index_rows = [(i, leaf["index_rows"]) for i, leaf in enumerate(tensors) if "index_rows" in leaf]
        self.aminmax = torch.aminmax
        self.unsafe = unsafe_writes(torch, self.mutated) if self.mutated else None
        self.outputs: list[Output] = entry.get("outputs") or [{"kind": "tensor"}] * self.out_spec.num_leaves
        # outputs eager makes as views of an input: remade on the caller's tensor where the loader copied it
        self.views = [(i, out["view_of"]) for i, out in enumerate(self.outputs) if "view_of" in out]
        self.signature: list[Parameter] = entry.get("signature") or []

    def _aoti(self, torch: Any, entry: Entry) -> Any:
        """The AOTInductor runner on the shipped library; its (input, output) call specs."""
        check_symbols(torch, self.name, entry.get("torch_symbols") or [], self.built_with)
        try:
            packs = chosen(entry)
            self.runner = opened(torch, self.name, self.file, self.device, self.built_with)
            self.run = self.runner.run
            # read only where needed: a load of weights in the library, packed nowhere, stays as it was
            needs_names = "weights" in entry or bool(packs)
            constants = self.runner.get_constant_names_to_original_fqns() if needs_names else {}
            if "weights" in entry:
                self.weights = mapped(torch, self.name, entry, self.directory, constants)
            lost = [c for c, how in packs.items() if c not in constants and required(how)]
            if lost:  # its kernel would read the dense weight, which it cannot
                raise RuntimeError(
                    f"compiled model {self.name!r}: its library has no weight {lost[0]} to pack, and runs only "
                    "with it packed; the install is damaged (reinstall the package)"
                )
            packs = {c: how for c, how in packs.items() if c in constants}
            repacked = packed(torch, self.name, packs, self._dense) if packs else {}
            if self.weights is not None or repacked:  # the mapped weights, the packed ones in their place
                self.weights = {**(self.weights or {}), **repacked}
                self.runner.update_constant_buffer(self.weights, False, "weights" in entry, True)  # no copy
            return self.runner.get_call_spec()
        except (AttributeError, TypeError, ImportError) as exc:
            if not runs_dense(entry):
                raise RuntimeError(
                    f"compiled model {self.name!r}: torch {torch.__version__} lacks the direct AOTInductor runner "
                    f"({exc}), and its {self.precision} weights run only packed as it loads"
                ) from None
            warnings.warn(
                f"compiled model {self.name!r}: torch {torch.__version__} lacks the direct AOTInductor "
                f"runner ({exc}); falling back to torch._inductor.aoti_load_package, which is slower "
                "to load and extracts the package to a temporary directory",
                RuntimeWarning,
                stacklevel=3,
            )
            from .pt2 import public_runner

            self.runner = public_runner(self.name, entry, self.directory)
            self.run = self.runner.loader.boxed_run
            return self.runner.loader.get_call_spec()

    def _dense(self) -> tuple[dict[str, Any], Any]:
        """The model's constants as shipped, and what holds them: the mapped weights, else the library's,
        read through a runner of torch's (a second one where the loader's own is not)."""
        if self.weights is not None:
            return self.weights, None
        import torch

        runner = self.runner
        if not hasattr(runner, "extract_constants_map"):
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(self.file, 1)
        return runner.extract_constants_map(False), runner

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Tensor inputs in the compiled order, after checking the call's structure."""
        unknown = sorted(set(kwargs) - set(self.kwarg_names))
        missing = [k for k in self.kwarg_names if k not in kwargs]
        if (unknown or missing or len(args) != self.n_args) and self.signature:
            args, kwargs = exported_layout(self.signature, self.n_args, self.kwarg_names, args, kwargs)
            unknown = sorted(set(kwargs) - set(self.kwarg_names))
            missing = [k for k in self.kwarg_names if k not in kwargs]
        if unknown or missing or len(args) != self.n_args:
            raise TypeError(
                f"compiled model {self.name!r} takes {self.n_args} positional input(s) and keyword "
                f"input(s) {list(self.kwarg_names)}; got {len(args)} positional and {sorted(kwargs)}"
                + (f" (unexpected: {unknown})" if unknown else "")
                + (f" (missing: {missing})" if missing else "")
            )
        given = (args, {k: kwargs[k] for k in self.kwarg_names})
        try:  # dicts in any key order, as eager takes them
            leaves = self.in_spec.flatten_up_to(given)
        except (TypeError, ValueError):
            raise TypeError(
                f"compiled model {self.name!r}: inputs do not have the structure it was built with "
                f"(expected {self.in_spec}, got {self.pytree.tree_structure(given)})"
            ) from None
        for index, value in self.constants:
            if type(leaves[index]) is not type(value) or leaves[index] != value:
                raise ValueError(
                    f"compiled model {self.name!r}: input {index} was fixed to {value!r} when the model "
                    f"was compiled; got {leaves[index]!r}"
                )
        return [leaves[i] for i in self.tensor_index]

    def reject(self, tensors: list[Any]) -> None:
        """Raise the error for the first tensor input that does not fit."""
        seen_at: dict[str, tuple[int, int, int]] = {}
        for position, tensor in enumerate(tensors):
            leaf = self.leaves[self.tensor_index[position]]
            expected = describe(leaf)
            where = f"compiled model {self.name!r}: input {position}"
            if not isinstance(tensor, self.tensor):
                raise TypeError(f"{where} must be a tensor ({expected}); got {type(tensor).__name__}")
            if tensor.layout is not self.strided:
                raise TypeError(f"{where} must be a dense tensor ({expected}); got one of layout {tensor.layout}")
            got = f"{str(tensor.dtype).replace('torch.', '')} on {tensor.device.type} with shape {list(tensor.shape)}"
            dtype, cpu, sizes, dims = self.checks[position]
            if tensor.dtype is not dtype or tensor.is_cpu is not cpu or not (cpu or tensor.is_cuda):
                raise TypeError(f"{where} must be {expected}; got {got}")
            if not fits(tensor.shape, sizes, dims, {}):
                raise ValueError(f"{where} must be {expected}; got {got}")
            for axis, _, _, root, mult, offset in dims:
                value = (tensor.shape[axis] - offset) // mult
                seen = seen_at.setdefault(root, (value, position, axis))
                if seen[0] != value:
                    raise ValueError(
                        f"{where}: axis {axis} gives {root} = {value}, but input {seen[1]} axis {seen[2]} "
                        f"gave {root} = {seen[0]}; the inputs must agree on it"
                    )
        raise AssertionError("no input was rejected")

    def check_writes(self, tensors: list[Any]) -> None:
        """Raise for an input the model writes into that eager would refuse to write, or that shares
        memory with another input: the compiled code reads every input as it was before the call."""
        problem = self.unsafe(tensors) if self.unsafe is not None else None
        if problem is not None:
            error, text = problem
            raise error(f"compiled model {self.name!r}: {text}")

    def check_indices(self, tensors: list[Any]) -> None:
        """Raise eager's IndexError for an index input with a value outside its table."""
        for position, rows in self.index_rows:
            tensor = tensors[position]
            if tensor.numel():
                low, high = (int(v) for v in self.aminmax(tensor))
                if low < 0 or high >= rows:
                    raise IndexError(
                        f"compiled model {self.name!r}: input {position} indexes a table of {rows} rows, "
                        f"so its values must be in [0, {rows}); got {low if low < 0 else high}"
                    )


def backend_runtime(name: str, entry: Entry, artifacts: str) -> Callable[..., Any]:
    """A model of another backend: its run-time module, shipped as ``_aoti/runtime/<backend>.py``."""
    import importlib.util

    backend = entry["backend"]
    path = os.path.join(artifacts, "runtime", f"{backend}.py")
    package = __name__.rpartition(".")[0]
    spec = importlib.util.spec_from_file_location(f"{package}._runtime_{backend}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"compiled model {name!r}: cannot load its run-time module {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    call = module.load(name, entry, os.path.join(artifacts, name))
    return lambda tensors, args, kwargs: call(*args, **kwargs)
