"""The AOTInductor backend: an exported program compiled into a shared library that the loader maps in place."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hatch_aoti.backends.interface import Backend, ProgramFacts, Request
from hatch_aoti.loader.packing import OPS
from hatch_aoti.settings.constants import HOST

if TYPE_CHECKING:
    from hatch_aoti.settings.cpu_targets import CpuTarget
    from hatch_aoti.settings.spec import ModelSpec


class AotiBackend(Backend):
    """The default: ``aoti_compile_and_package``, unpacked; no Python tracing or compiling at run time."""

    name = "aoti"
    in_helpers = True

    def settings(
        self, user_configs: dict[str, Any], cpu: CpuTarget, spec: ModelSpec, facts: ProgramFacts
    ) -> dict[str, Any]:
        mapped = MAPPED_WEIGHTS if spec.weights in ("mapped", "external") and spec.device == "cpu" else {}
        return inductor_configs({**fast_defaults(spec, facts), **mapped, **user_configs}, cpu)

    def compile(self, request: Request) -> dict[str, Any]:
        return compile_program(request.exported, request.out, request.settings, request.work)


#: Where hatch-aoti departs from Inductor's defaults, for code that ships in wheels:
#: - line tables (``-g1``) triple the size of a small model's library and carry build
#:   paths; release builds of torch itself ship without them;
#: - without dynamic threads, Inductor writes the build machine's thread count into the
#:   kernels (one thread: no parallel loops at all), so the library would run with the
#:   build machine's parallelism everywhere, and its bytes would depend on it;
#: - a fixed name for the generated files, which are otherwise named by a digest that
#:   includes the build's paths;
#: - no size asserts: they run only under ``AOTI_RUNTIME_CHECK_INPUTS``, and with weight
#:   prepacking they name Inductor's fusion functions by their memory address, so two
#:   builds of one model would differ.
#: ``inductor-configs`` can change any of them.
#: ``weights = "mapped"`` (CPU models): the weights stay out of the library, in a file the
#: loader maps instead of copying (see ``pt2.py``).
MAPPED_WEIGHTS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}
#: Fast and still portable (figures and the settings left out: docs/configuration.md#fast-defaults):
#: - freezing: the weights become constants of the graph, so what depends on them alone
#:   (transposed linear weights, batch norms folded into convolutions) is computed once, at
#:   build time; the wheel ships those constants instead of the state dict;
#: - weight prepacking, with the packed weights shipped as the dense tensors they come from
#:   (oneDNN picks packed layouts for the CPU at hand): the loader packs the convolutions' again
#:   for the CPU it runs on (``loader.packing.OPS``), and the linear layers' too where ``HATCH_AOTI_PACK=all``
#:   says so (a copy of those weights in each process, for a few percent on some CPUs);
#: - a GELU after a float32 linear layer runs as a kernel of its own, not as oneDNN's post-op
#:   (``_torch_private.keep_gelu_apart``).
#: A packed matrix product takes oneDNN's path on every call, which costs more than MKL's for a
#: small one, so models whose products by a weight average less work than this many multiply-adds
#: are not prepacked, unless their convolutions, which run on oneDNN either way, outnumber those
#: products (chosen between measured sizes: docs/configuration.md).
PREPACK_FROM_MACS = 10_000_000
#: Freezing holds the weights it computes anew (convolutions with batch norms folded in) beside
#: the originals while the model compiles; from this size on it is left to the user.
FREEZE_BELOW = 2**30
FAST_DEFAULTS: dict[str, Any] = {
    "freezing": True,
    "cpp.weight_prepack": True,
}


def fast_defaults(spec: ModelSpec, facts: ProgramFacts) -> dict[str, Any]:
    """``optimize = "host"`` and int8 variants freeze at any size; a model whose packed weights cannot ship
    dense, or a float model whose matrix products are too small to gain from packing and at least as
    many as its convolutions (which gain at any size), is not packed."""
    configs = dict(FAST_DEFAULTS)
    macs = facts.weighted_macs
    small = macs is not None and macs < PREPACK_FROM_MACS and facts.weighted_products >= facts.convolutions
    small = small and spec.precision[0] != "int8"  # oneDNN runs int8 products packed at any size
    if not facts.repackable or small:
        configs["cpp.weight_prepack"] = False
    large = facts.weights_bytes is not None and facts.weights_bytes >= FREEZE_BELOW
    if spec.optimize != HOST and large and spec.precision[0] != "int8":  # int8 kernels come only with freezing
        configs["freezing"] = False
    return configs


def packs_weights(configs: dict[str, Any]) -> bool:
    """Whether a compile prepacks weights for oneDNN.

    Inductor registers its weight-packing passes once per process, at the first freezing
    compile, as that compile's settings say; so models that pack and models that do not
    never share a process (models of one kind do).
    """
    return bool(configs.get("freezing")) and bool(configs.get("cpp.weight_prepack", True))


WHEEL_DEFAULTS: dict[str, Any] = {
    "aot_inductor.enable_line_tables": False,
    "cpp.dynamic_threads": True,
    "aot_inductor.model_name_for_generated_files": "model",
    "size_asserts": False,
}


def inductor_configs(user_configs: dict[str, Any], cpu: CpuTarget) -> dict[str, Any]:
    """The settings a model compiles with: wheel defaults, then its CPU target's, then the user's."""
    import torch._inductor.config

    known = set(torch._inductor.config.get_config_copy())
    defaults = {k: v for k, v in WHEEL_DEFAULTS.items() if k in known}  # older releases lack some
    if getattr(torch._inductor.config.cpp, "enable_kernel_profile", False):  # TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE
        defaults["cpp.enable_kernel_profile"] = True  # recorded, so `hatch-aoti inspect` and `profile` see it
    # The CPU target applies to CUDA models too: their wrapper is CPU code built with -march.
    return {**defaults, **cpu.inductor_configs, **user_configs}


def compile_program(exported: Any, out_dir: Path, configs: dict[str, Any], work: Path) -> dict[str, Any]:
    """Compile ``exported`` and lay its files out in ``out_dir``; the manifest entry's file fields.

    Each compile gets an Inductor cache of its own under ``work``: the generated files
    have fixed names, and Inductor reuses a library it finds under the same name, which
    would be another model's when two models share their graph code (layers of other sizes).
    """
    import shutil

    import torch
    import torch._inductor

    from hatch_aoti import _torch_private
    from hatch_aoti.backends.pt2 import unpack_pt2
    from hatch_aoti.backends.rewrites import whole_window_pools, zero_pads_into_convolutions

    _torch_private.before_compile()
    whole_window_pools(exported)  # each done once: the same program again has nothing to rewrite
    zero_pads_into_convolutions(exported)
    pt2, inductor = work / "model.pt2", work / "inductor"
    shutil.rmtree(inductor, ignore_errors=True)
    packing = _torch_private.packed_weights(OPS) if packs_weights(configs) else contextlib.nullcontext()
    try:
        # Freezing folds weights only where no gradient can be asked for.
        with (
            _torch_private.inductor_cache(inductor),
            _torch_private.portable_paths(),
            _torch_private.distinct_constant_names(),
            torch.no_grad(),
        ):
            with packing as packed:
                torch._inductor.aoti_compile_and_package(
                    exported, package_path=str(pt2), inductor_configs=dict(configs)
                )
        if packed is not None:
            packed.check()
        entry = unpack_pt2(pt2, out_dir)
        if packed is not None and packed.replays:
            entry["packing"] = dict(sorted(packed.replays.items()))
        return entry
    finally:
        _torch_private.release_trace()  # the folded weights, once the library holds its own
        pt2.unlink(missing_ok=True)
        shutil.rmtree(inductor, ignore_errors=True)
