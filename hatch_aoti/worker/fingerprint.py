"""The cache key: a digest of everything that changes a compiled, verified artifact.

It is computed from the *exported program* (graph, tensor metadata of every node,
signature, ranges, and the bytes of every weight and constant), not from source files:
a change to model code anywhere, in the project or in a dependency, that changes what
torch.export sees changes the key; an unrelated edit does not. Added to that: what the
build checks (inputs, dynamic dims, tolerances), the Inductor settings of the model and
of the whole Inductor config (``TORCHINDUCTOR_*`` variables included), the torch build,
the C++ compiler, the CPU target (and CPU, for ``native``), the GPU's compute capability
for CUDA models, and hatch-aoti's own code. Not the model's name or the project: the
same model in two projects shares one entry.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch


def _tensor_digest(digest: Any, name: str, tensor: Any) -> None:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not isinstance(tensor, torch.Tensor):
        digest.update(f"{name}:{type(tensor).__name__}:{tensor!r}\n".encode())
        return
    if is_traceable_wrapper_subclass(tensor):  # a quantized weight, say: its inner tensors hold the data
        inner, context = tensor.__tensor_flatten__()
        digest.update(f"{name}:{type(tensor).__qualname__}:{context!r}\n".encode())
        for attr in inner:
            _tensor_digest(digest, f"{name}.{attr}", getattr(tensor, attr))
        return
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
    nbytes = t.numel() * t.element_size()
    if nbytes:  # hashed in place: a copy of a large weight would double its memory
        digest.update(memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())))


def _node_meta(node: Any) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}{tuple(str(s) for s in val.shape)}{tuple(str(s) for s in val.stride())}{val.device}"
    return repr(val) if isinstance(val, (int, float, bool, str, type(None))) else type(val).__name__


def program_digest(exported: Any) -> str:
    """Graph, signature, ranges, node metadata, weights and constants of an ExportedProgram."""
    from torch.utils import _pytree as pytree

    digest = hashlib.sha256()
    digest.update(exported.graph_module.code.encode())
    digest.update(str(exported.graph_signature).encode())
    digest.update(str(sorted((str(k), str(v)) for k, v in exported.range_constraints.items())).encode())
    digest.update(pytree.treespec_dumps(exported.call_spec.in_spec).encode())
    digest.update(pytree.treespec_dumps(exported.call_spec.out_spec).encode())
    for node in exported.graph.nodes:
        digest.update(f"{node.op}:{node.name}:{node.target}:{_node_meta(node)}\n".encode())
    for name, tensor in sorted(exported.state_dict.items()):
        _tensor_digest(digest, f"state:{name}", tensor)
    for name, value in sorted(exported.constants.items()):
        _tensor_digest(digest, f"const:{name}", value)
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def compiler_identity() -> str:
    """The C++ compiler AOTInductor will call, by resolved path and ``--version`` output."""
    try:
        from hatch_aoti._torch_private import cpp_compiler

        compiler = cpp_compiler()
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"
    path = shutil.which(compiler) or compiler
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unavailable"
    return f"{path}\n{version}"


def host_cpu() -> str:
    """Machine and ISA flags; the compiled code depends on them when it targets the build CPU."""
    from hatch_aoti.settings.cpu_targets import host_flags

    return f"{platform.machine()} {' '.join(sorted(host_flags()))}"


@functools.lru_cache(maxsize=1)
def own_identity() -> str:
    """hatch-aoti's version and a digest of its own code and templates.

    The version alone would let a development install (or a fix released under the
    same number) reuse entries made by different code.
    """
    from hatch_aoti import __version__
    from hatch_aoti.pipeline.artifacts import template_path

    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*package.rglob("*.py"), *template_path("editable_finder.py").parent.glob("*.py")]):
        digest.update(f"{path.relative_to(path.parent.parent).as_posix()}\n".encode())
        digest.update(path.read_bytes())
    return f"{__version__} {digest.hexdigest()}"


def inductor_environment() -> dict[str, Any]:
    """Inductor's whole config as its own cache sees it, and every ``TORCHINDUCTOR_*`` variable.

    Some variables are read outside the config module (``TORCHINDUCTOR_DEBUG_COMPILE`` by
    the C++ builder, say); the cache directory is not one that changes code.
    """
    import os

    import torch._inductor.config as inductor_config

    env = {k: v for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR"}
    return {"config": inductor_config.save_config_portable(), "env": dict(sorted(env.items()))}


def cuda_capability(device: str) -> list[int] | None:
    if not device.startswith("cuda"):
        return None
    return list(torch.cuda.get_device_capability(torch.device(device)))


def cache_key(
    exported: Any, spec: Any, plan: Any, inductor_configs: dict[str, Any], backend_key: dict[str, Any] | None = None
) -> str:
    """The key of one model: ``spec`` is its ModelSpec, ``plan`` its InputPlan, ``backend_key`` what its
    backend adds (:meth:`hatch_aoti.backends.Backend.key`)."""
    parts = {
        "backend": [spec.backend, backend_key or {}],
        "program": program_digest(exported),
        "inputs": [plan.description, {n: list(b) for n, b in plan.dims.items()}],
        "checks": [spec.verify, spec.rtol, spec.atol],
        "device": spec.device,
        "inductor_configs": inductor_configs,
        "inductor": inductor_environment(),
        "torch": [torch.__version__, torch.version.git_version, torch.version.cuda],
        "compiler": compiler_identity(),
        "cpu_target": spec.cpu_target,
        "cpu": host_cpu() if spec.cpu_target == "native" else platform.machine(),
        "cuda": cuda_capability(spec.device),
        "hatch_aoti": own_identity(),
    }
    precision = spec.precision[0]
    if precision != "float32":  # a variant: its check and its calibration (float32 keys stay as they were)
        parts["precision"] = [precision, spec.accuracy.get(precision, {}), spec.calibration]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
