"""The cache key: a digest of everything that changes a compiled, verified artifact.

It is computed from the *exported program* (graph, tensor metadata of every node,
signature, ranges, and the bytes of every weight and constant), not from source files:
a change to model code anywhere, in the project or in a dependency, that changes what
torch.export sees changes the key; an unrelated edit does not. Added to that: the model
spec (inputs, dynamic dims, inductor configs, tolerances), the torch build, the C++
compiler's identity, the CPU target, the effective inductor configs, and hatch-aoti's
own version and code.
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
    if not isinstance(tensor, torch.Tensor):
        digest.update(f"{name}:{type(tensor).__name__}:{tensor!r}\n".encode())
        return
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
    nbytes = t.numel() * t.element_size()
    if nbytes:
        digest.update(ctypes.string_at(t.data_ptr(), nbytes))


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
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - an unknown compiler still gets a key
        return f"unknown ({type(exc).__name__})"
    path = shutil.which(compiler) or compiler
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unavailable"
    return f"{path}\n{version}"


def host_cpu() -> str:
    """Machine and ISA flags; the compiled code depends on them when it targets the build CPU."""
    from hatch_aoti.cpu_targets import host_flags

    return f"{platform.machine()} {' '.join(sorted(host_flags()))}"


@functools.lru_cache(maxsize=1)
def own_identity() -> str:
    """hatch-aoti's version and a digest of its own code and templates.

    The version alone would let a development install (or a fix released under the
    same number) reuse entries made by different code.
    """
    from hatch_aoti import __version__
    from hatch_aoti.artifacts import template_path

    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted([*package.glob("*.py"), *template_path().parent.glob("*.py")]):
        digest.update(f"{path.name}\n".encode())
        digest.update(path.read_bytes())
    return f"{__version__} {digest.hexdigest()}"


def cache_key(exported: Any, spec_json: dict[str, Any], plan_description: dict[str, Any],
              inductor_configs: dict[str, Any], cpu_target: str) -> str:  # fmt: skip
    parts = {
        "program": program_digest(exported),
        "spec": spec_json,
        "inputs": plan_description,
        "inductor_configs": inductor_configs,
        "torch": [torch.__version__, torch.version.git_version, torch.version.cuda],
        "compiler": compiler_identity(),
        "cpu_target": cpu_target,
        "cpu": host_cpu() if cpu_target == "native" else platform.machine(),
        "hatch_aoti": own_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
