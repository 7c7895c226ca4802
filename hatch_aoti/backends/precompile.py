"""torch's precompile (``torch.compile(..., fullgraph=True).aot_compile``): Dynamo's guards and Python semantics kept.

What it compiles is the generated loader's ``precompile.call(module, *args, **kwargs)``, so the saved
artifact refers to a function that exists wherever the wheel is installed; the module is
built when the model is loaded, by its factory, from the wheel's own code and weights.
The artifact holds Python bytecode and C++ kernel sources: it loads only under the exact
Python and torch that built it, and its kernels are compiled when it loads.
"""

from __future__ import annotations

import importlib
import math
import platform
import re
import shutil
import sys
from typing import TYPE_CHECKING, Any

from hatch_aoti.backends.interface import Backend, Pins, ProgramFacts, Request

if TYPE_CHECKING:
    from hatch_aoti.settings.cpu_targets import CpuTarget
    from hatch_aoti.settings.spec import ModelSpec


class PrecompileBackend(Backend):
    name = "precompile"

    def settings(
        self, user_configs: dict[str, Any], cpu: CpuTarget, spec: ModelSpec, facts: ProgramFacts
    ) -> dict[str, Any]:
        from hatch_aoti.backends.aoti import inductor_configs

        return inductor_configs(user_configs, cpu)

    def key(self) -> dict[str, Any]:
        return {"python": platform.python_version()}

    def check(self, spec: ModelSpec) -> list[tuple[str, str]]:
        problems = [
            (
                f"{spec.path}.dynamic.{name}",
                f"is the rule {rule!r}, which the precompile backend cannot compile "
                "(Dynamo takes bounds, not rules): use the aoti backend for this model",
            )
            for name, rule in spec.dynamic.items()
            if isinstance(rule, str)
        ]
        small = {
            name: dim.min or 0 for name, dim in spec.dynamic.items() if not isinstance(dim, str) and (dim.min or 2) < 2
        }
        if math.prod(3 - low for low in small.values()) > MAX_REGIONS:
            problems.append(
                (
                    f"{spec.path}.dynamic",
                    f"sizes below 2 of {', '.join(small)} are compiled on their own, "
                    f"for each combination: more than {MAX_REGIONS} compiles; set `min = 2` for some",
                )
            )
        return problems

    def compile(self, request: Request) -> dict[str, Any]:
        """One saved function per region of sizes: Inductor specialises some lowerings by size, and
        Dynamo then guards a narrower range than declared; the regions cover the whole range."""
        import torch

        from hatch_aoti._torch_private import before_compile, inductor_cache
        from hatch_aoti.pipeline.artifacts import sha256

        before_compile()
        call = importlib.import_module(f"{request.loader}.precompile").call
        inductor = request.work / "inductor"
        request.out.mkdir(parents=True, exist_ok=True)
        regions: list[dict[str, Any]] = []
        queue: list[Box] = [_declared_box(request.plan, request.spec)]
        while queue:
            box = queue.pop(0)
            if len(regions) >= MAX_REGIONS:
                raise RuntimeError(f"the declared ranges need more than {MAX_REGIONS} compiled regions; narrow them")
            if (small := _small_sizes_apart(box)) is not None:
                queue[:0] = small
                continue
            path = request.out / (f"model-{len(regions)}.bin" if box else "model.bin")
            shutil.rmtree(inductor, ignore_errors=True)
            try:
                with torch.no_grad(), inductor_cache(inductor):
                    args, kwargs = _marked(request.plan, box)
                    compiled = torch.compile(call, fullgraph=True, options=request.settings)
                    aot = compiled.aot_compile  # type: ignore[attr-defined]
                    aot(((request.module, *args), kwargs)).save_compiled_function(str(path))
            except Exception as exc:
                narrower = _split(box, exc, request.plan)
                if narrower is None:
                    raise
                queue[:0] = narrower
                continue
            finally:
                shutil.rmtree(inductor, ignore_errors=True)
            path.chmod(0o644)
            regions.append({"file": path.name, "sha256": sha256(path), "dims": box})
        python, torch_version = platform.python_version(), str(torch.__version__)
        main = regions[0]
        return {
            "file": main["file"],
            "sha256": main["sha256"],
            **({"regions": regions} if len(regions) > 1 or regions[0]["dims"] else {}),
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
        }

    def pins(self, torch_version: str) -> Pins:
        from packaging.version import Version

        return Pins(f"torch=={Version(torch_version).public}", f"cp{sys.version_info.major}{sys.version_info.minor}")


#: More regions than this means bounds far wider than the model's code allows for one compile.
MAX_REGIONS = 16
_GUARD = re.compile(r"L\['(args|kwargs)'\]((?:\[[^\]]+\])+)\.size\(\)\[(\d+)\]")


Box = dict[str, list[Any]]
"""Each dim's [min, max] (max ``None``: unbounded) in one region of sizes."""


def _declared_box(plan: Any, spec: Any) -> Box:
    """Each dim's range: sizes below 2 only where ``dynamic`` declares them (Dynamo's own range starts at 2)."""
    declared = spec.dynamic if spec is not None else {}
    return {
        name: [low if getattr(declared.get(name), "min", None) is not None else max(low, 2), high]
        for name, (low, high) in plan.dims.items()
    }


def _small_sizes_apart(box: Box) -> list[Box] | None:
    """Sizes 0 and 1 compiled on their own (Dynamo specialises them), then the rest; ``None`` if there are none."""
    for name, (low, high) in box.items():
        if low < 2 and (high is None or low < high):
            return [{**box, name: [low, low]}, {**box, name: [low + 1, high]}]
    return None


def _split(box: Box, exc: Exception, plan: Any) -> list[Box] | None:
    """The box cut where the compile's guard ends: the part it covers first, then the rest; ``None`` if
    the error is not a narrower guard on one of the box's dims."""
    text = str(exc)
    if "satisfy the generated guard" not in text:
        return None
    sources = _sources(plan)
    for guard in text.split("satisfy the generated guard")[1:]:
        guard = guard.split("\n")[0]
        for found in _GUARD.finditer(guard):
            name = sources.get((found[1], found[2], int(found[3])))
            if name is None or box[name][0] == box[name][1]:
                continue
            src = re.escape(found[0])
            highs = [int(m) for m in re.findall(src + r"\s*<=\s*(\d+)", guard)]
            highs += [int(m) - 1 for m in re.findall(src + r"\s*<\s*(\d+)", guard)]
            low, high = box[name]
            ends = [h for h in highs if h >= low] or ([low] if re.search(src + r"\s*==", guard) else [])
            if ends and (high is None or min(ends) < high):  # specialised to the example's size: ends at low
                return [{**box, name: [low, min(ends)]}, {**box, name: [min(ends) + 1, high]}]
    return None


def _sources(plan: Any) -> dict[tuple[str, str, int], str]:
    """Dynamo's name of each dynamic axis (``L['args'][0].size()[0]``, as parts) -> the dim's name."""
    import torch
    from torch.utils import _pytree as pytree

    paths = [p for p, leaf in pytree.tree_flatten_with_path(plan.export_sample)[0] if isinstance(leaf, torch.Tensor)]
    out = {}
    for path, axes in zip(paths, plan.axis_names):
        where = "args" if path[0].idx == 0 else "kwargs"  # type: ignore[attr-defined]
        rest = pytree.keystr(path[1:])
        for axis, name in axes.items():
            out[(where, rest, axis)] = name
    return out


def _marked(plan: Any, box: dict[str, list[int]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The export sample at the box's smallest sizes, each axis of a range in the box marked for Dynamo."""
    import torch
    from torch.utils import _pytree as pytree

    from hatch_aoti.worker.inputs import resized

    leaves, spec = pytree.tree_flatten(resized(plan, {name: low for name, (low, _) in box.items()}))
    position = 0
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        leaves[index] = leaf = leaf.clone()
        for axis, name in plan.axis_names[position].items():
            low, high = box[name]
            if high is None or low < high:
                torch._dynamo.mark_dynamic(leaf, axis, min=low, **({} if high is None else {"max": high}))
        position += 1
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return tuple(args), dict(kwargs)
