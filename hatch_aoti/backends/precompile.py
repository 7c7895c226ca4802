"""torch's precompile (``torch.compile(..., fullgraph=True).aot_compile``): Dynamo's guards and Python semantics kept.

What it compiles is the generated loader's ``_call(module, *args, **kwargs)``, so the saved
artifact refers to a function that exists wherever the wheel is installed; the module is
built when the model is loaded, by its factory, from the wheel's own code and weights.
The artifact holds Python bytecode and C++ kernel sources: it loads only under the exact
Python and torch that built it, and its kernels are compiled when it loads.
"""

from __future__ import annotations

import importlib
import platform
import shutil
import sys
from typing import Any

from hatch_aoti.backends import Backend, Pins, Request


class PrecompileBackend(Backend):
    name = "precompile"

    def settings(self, user_configs: dict[str, Any], target: Any, spec: Any) -> dict[str, Any]:
        from hatch_aoti.backends.aoti import inductor_configs

        return inductor_configs(user_configs, target)

    def key(self) -> dict[str, Any]:
        return {"python": platform.python_version()}

    def check(self, spec: Any) -> list[tuple[str, str]]:
        return [
            (f"{spec.path}.dynamic.{name}.min", f"is {dim.min}, but the precompile backend cannot take sizes below 2 "
             "(torch.compile specialises sizes 0 and 1): set min = 2, or use the aoti backend")
            for name, dim in spec.dynamic.items() if dim.min is not None and dim.min < 2
        ]  # fmt: skip

    def compile(self, request: Request) -> dict[str, Any]:
        import torch
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        from hatch_aoti.artifacts import sha256

        call = importlib.import_module(request.loader)._call
        args, kwargs = _marked(request.plan)
        inductor, path = request.work / "inductor", request.out / "model.bin"
        shutil.rmtree(inductor, ignore_errors=True)
        request.out.mkdir(parents=True, exist_ok=True)
        try:
            with torch.no_grad(), temporary_cache_dir(str(inductor)):
                compiled = torch.compile(call, fullgraph=True, options=request.settings)
                compiled.aot_compile(((request.module, *args), kwargs)).save_compiled_function(str(path))
        finally:
            shutil.rmtree(inductor, ignore_errors=True)
        path.chmod(0o644)
        python, torch_version = platform.python_version(), str(torch.__version__)
        return {
            "file": path.name,
            "sha256": sha256(path),
            "python": python,
            "torch": torch_version,
            "needs": {
                "module": "built by the model's factory (`factory`) when the model is loaded, from the wheel's "
                          "own code and weights",
                "python": python,
                "torch": torch_version,
                "c++ compiler": "the kernels are compiled when the model is loaded",
                "writes": "compiled kernels to Inductor's cache (TORCHINDUCTOR_CACHE_DIR)",
            },
        }  # fmt: skip

    def pins(self, torch_version: str) -> Pins:
        from packaging.version import Version

        return Pins(f"torch=={Version(torch_version).public}", f"cp{sys.version_info.major}{sys.version_info.minor}")


def _marked(plan: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of the export sample with each dynamic axis marked for Dynamo, in its bounds (2 at least)."""
    import torch
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(plan.export_sample)
    position = 0
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        leaves[index] = leaf = leaf.clone()
        for axis, name in plan.axis_names[position].items():
            low, high = plan.dims[name]
            bounds = {"min": max(low, 2), **({"max": high} if high is not None else {})}
            torch._dynamo.mark_dynamic(leaf, axis, **bounds)
        position += 1
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return tuple(args), dict(kwargs)
