"""A model's lower-precision variants: how each is exported, and how it is checked against float32 eager.

A variant takes and returns what the float32 model does: its casts are part of the exported program,
so Inductor fuses them into the kernels around them, and callers never change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hatch_aoti.settings.constants import ACCURACY
from hatch_aoti.worker.batchnorm import CONV_LAYERS, folded_batch_norms
from hatch_aoti.worker.checks import Prepared
from hatch_aoti.worker.verify import VerificationFailed, compare, copied, reference, run_or_fail

#: Layers whose arithmetic a bfloat16 variant does in bfloat16. The rest (norms, softmax, residual
#: additions, embeddings) stays in float32, which keeps a variant's error near OpenVINO's mixed
#: precision rather than a whole-model cast's (docs/performance.md#precision-variants).
BFLOAT16_LAYERS = (torch.nn.Linear, *CONV_LAYERS)


#: The x86 target an int8 variant of a model built for the key's target is compiled for: Inductor's AVX2
#: kernels round each activation an int8 layer quantizes one value at a time (docs/configuration.md#precision).
WIDER_TARGET = {"x86-64-v3": "x86-64-v4"}


def variants(
    model: Prepared, flags: set[str] | None = None, caps: dict[str, bool] | None = None
) -> tuple[list[Prepared], list[str]]:
    """One prepared model per precision the model lists, each named as its folder (``name@bfloat16``) and
    built for its target, its precision listed first, then those listed after it (what an int8 variant's
    unquantized convolutions compute in); and what the build log says of an int8 variant's target. ``flags`` and
    ``caps``: this machine's /proc/cpuinfo flags and CPUID answers (read here where not given)."""
    from hatch_aoti.loader.host import cpu_problem, cpuid
    from hatch_aoti.loader.schema import Cpu
    from hatch_aoti.settings.cpu_targets import TARGETS

    found, notes = [], []
    for label, precision in model.spec.variants:
        target = model.spec.cpu_target
        wider = WIDER_TARGET.get(target) if precision == "int8" else None
        if wider is not None:
            cpu = Cpu(arch=TARGETS[wider].arch, target=wider, features=list(TARGETS[wider].features))
            caps = cpuid(torch) if caps is None else caps
            problem = cpu_problem(cpu, flags=None if flags is None else frozenset(flags), cpuid=caps, hint=False)
            if problem is None:
                notes.append(f"{label}: {WIDENED.format(target=target, wider=wider)}")
                target = wider
            else:
                notes.append(f"{label}: {KEPT_TARGET.format(target=target, wider=wider, problem=problem)}")
        later = model.spec.precision[model.spec.precision.index(precision) + 1 :]
        spec = dataclasses.replace(model.spec, name=label, precision=(precision, *later), cpu_target=target)
        found.append(dataclasses.replace(model, spec=spec))
    return found, notes


WIDENED = (
    "built for {wider} rather than {target}: CPUs without AVX-512 (AVX-VNNI alone included) load the next "
    "variant listed"
)
KEPT_TARGET = (
    "built for {target}, not {wider}, since this machine {problem} and could not verify it: it runs on more "
    "CPUs, and slower on those with AVX-512 than a build on a machine that has it"
)


#: What the build log says of an int8 variant built where there is no VNNI, whose saturating products
#: would make its verification judge numbers no CPU that loads it computes.
NARROWED = "; activations in 7 bits, since this machine has no VNNI to verify full-range products on"


def has_vnni() -> bool:
    """Whether this machine multiplies full-range int8 activations as the CPUs that load int8 do."""
    from hatch_aoti.loader.host import cpuid, precision_problem

    return precision_problem("int8", cpuid(torch)) is None


def precision_of(model: Prepared) -> str:
    return model.spec.precision[0]


def export(model: Prepared, args: Any, kwargs: Any, dynamic_shapes: Any) -> tuple[Any, str | None, list[str]]:
    """The variant's exported program; for ``int8`` what was quantized (for the log and the manifest); and
    the precisions besides its own it computes in (the manifest's ``uses``)."""
    precision, module = precision_of(model), model.module
    # an int8 variant's convolutions, without samples to calibrate them on, take the next variant's precision
    later = model.spec.precision[1:2] if precision == "int8" and not model.calibration else ()
    convolutions = later == ("bfloat16",) and any(isinstance(m, CONV_LAYERS) for m in module.modules())
    if precision == "bfloat16" or convolutions:
        module, _ = folded_batch_norms(module, args, kwargs, dynamic_shapes)
    if precision == "int8":
        from hatch_aoti.worker.int8 import int8_program

        full, rest = has_vnni(), torch.bfloat16 if convolutions else torch.float32
        program, quantized = int8_program(
            module, args, kwargs, dynamic_shapes, model.calibration, reduce_range=not full, rest=rest
        )
        uses = [quantized.rest] if quantized.rest != "float32" else []
        return program, quantized.describe() + ("" if full else NARROWED), uses
    with bfloat16_layers(module) if precision == "bfloat16" else contextlib.nullcontext():
        return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes), None, []


def lowering_modules(model: Prepared) -> list[str]:
    """What a compile process imports before it loads the variant's program: for ``int8``, torchao's
    quantizer module, which registers its quantize ops and the passes that fuse them into int8 kernels."""
    if precision_of(model) != "int8":
        return []
    from hatch_aoti.worker.int8 import LOWERING

    return [LOWERING]


def _is_conv1d(module: Any) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers: an ``addmm`` with the weight stored transposed)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(module.weight, torch.Tensor)


@contextlib.contextmanager
def bfloat16_layers(module: torch.nn.Module) -> Iterator[int]:
    """While exporting: each float32 linear or convolution layer with bfloat16 weights, casting its input to
    bfloat16 and its output back. The module is as it was afterwards (it is the float32 variant and the
    reference); the exported program keeps the bfloat16 weights, half the size."""
    swapped: list[tuple[torch.nn.Module, dict[str, Any]]] = []
    try:
        for layer in module.modules():
            if not (isinstance(layer, BFLOAT16_LAYERS) or _is_conv1d(layer)) or layer.weight.dtype != torch.float32:
                continue
            saved = {"weight": layer.weight, "bias": layer.bias, "forward": layer.__dict__.get("forward")}
            for name in ("weight", "bias"):
                value = getattr(layer, name)
                if isinstance(value, torch.Tensor):
                    setattr(layer, name, torch.nn.Parameter(value.detach().to(torch.bfloat16), requires_grad=False))
            layer.forward = _in_bfloat16(type(layer).forward.__get__(layer))
            swapped.append((layer, saved))
        yield len(swapped)
    finally:
        for layer, saved in reversed(swapped):
            layer.weight, layer.bias = saved["weight"], saved["bias"]
            if saved["forward"] is None:
                del layer.forward
            else:
                layer.forward = saved["forward"]


def _in_bfloat16(forward: Callable[..., Any]) -> Callable[..., Any]:
    def call(x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            return forward(x, *args, **kwargs)
        return forward(x.to(torch.bfloat16), *args, **kwargs).to(torch.float32)

    return call


def limits_of(report: dict[str, Any]) -> dict[str, float]:
    """The check a variant passed at build time, from its verification report."""
    return {k: float(report[k]) for k in ("rel_error", "cosine")}


def limits(model: Prepared) -> dict[str, float]:
    """The variant's check: the user's ``accuracy`` over the precision's defaults."""
    precision = precision_of(model)
    return {**ACCURACY[precision], **model.spec.accuracy.get(precision, {})}


def verify_variant(
    module: Any, samples: list[tuple[str, Any]], compiled: Callable[..., Any], precision: str, limit: dict[str, float]
) -> tuple[dict[str, Any], dict[str, float]]:
    """Run float32 eager and the variant on every sample: the same structure, types and dtypes, outputs and
    mutated inputs, and each floating one within ``limit`` of a float64 run (of eager where there is none).
    Returns the report that ships and the measured errors, which vary from run to run and do not."""
    tried, worst = [], {"rel_error": 0.0, "cosine": 1.0}
    against = set()
    for label, sample in samples:
        shapes = [list(t.shape) for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor)]
        (e_args, e_kwargs), (c_args, c_kwargs) = copied(sample), copied(sample)
        with torch.no_grad():
            expected = run_or_fail(module, e_args, e_kwargs, f"eager model failed on {label} inputs {shapes}")
            actual = run_or_fail(
                compiled, c_args, c_kwargs, f"compiled {precision} model failed on {label} inputs {shapes}"
            )
        wide = reference(module, *copied(sample))
        against.add("float64 reference" if wide is not None else "eager")
        inputs = ((e_args, e_kwargs), (c_args, c_kwargs))
        problems = variant_problems(label, expected, actual, wide, inputs, limit, worst)
        if problems:
            raise VerificationFailed(
                f"the {precision} variant differs from float32 eager on {label} inputs {shapes}: "
                + "; ".join(problems),
                mismatch=True,
            )
        tried.append({"inputs": label, "shapes": shapes})
    report = {"passed": True, "precision": precision, "against": sorted(against), **limit, "tried": tried}
    return report, worst


#: Tolerances that let :func:`compare` check only what must match exactly: structure, types, dtypes, NaN.
LOOSE = 1e300


def variant_problems(
    label: str,
    expected: Any,
    actual: Any,
    exact: Any,
    inputs: tuple[Any, Any],
    limit: dict[str, float],
    worst: dict[str, float],
) -> list[str]:
    """How a variant's outputs (and the inputs it wrote into, ``inputs`` = eager's and the variant's) are
    not what float32 eager's are: their structure, types and dtypes, then each floating one's relative
    error and cosine against ``exact`` (a float64 run's outputs, or ``None``), within ``limit``."""
    problems = compare(label, expected, actual, LOOSE, LOOSE).problems
    if not problems:
        problems += _errors("output", expected, actual, exact, limit, worst)
        problems += _errors("input", *inputs, None, limit, worst)
    return problems


def _errors(
    what: str, eager: Any, variant: Any, exact: Any, limit: dict[str, float], worst: dict[str, float]
) -> list[str]:
    """Each floating leaf's relative error norm and cosine against ``exact`` (else eager), within ``limit``."""
    e_leaves, spec = pytree.tree_flatten_with_path(eager)
    v_leaves = pytree.tree_leaves(variant)
    r_leaves = pytree.tree_leaves(exact) if exact is not None else []
    if len(r_leaves) != len(e_leaves):
        r_leaves = [leaf for _, leaf in e_leaves]
    problems = []
    for (path, e), v, r in zip(e_leaves, v_leaves, r_leaves):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel()):
            continue
        if not (isinstance(r, torch.Tensor) and r.shape == e.shape):
            r = e
        r, v = r.detach().cpu().to(torch.float64).flatten(), v.detach().cpu().to(torch.float64).flatten()
        finite = torch.isfinite(r) & torch.isfinite(v)
        r, v = r[finite], v[finite]
        scale, distance = float(r.norm()), float((v - r).norm())
        rel = distance / scale if scale > 0 else (0.0 if distance == 0 else math.inf)
        norms = scale * float(v.norm())
        cosine = float(torch.dot(v, r)) / norms if norms > 0 else (1.0 if distance == 0 else 0.0)
        worst["rel_error"], worst["cosine"] = max(worst["rel_error"], rel), min(worst["cosine"], cosine)
        if rel > limit["rel_error"] or cosine < limit["cosine"]:
            problems.append(
                f"{what}{pytree.keystr(path)}: relative error {rel:.3g} (at most {limit['rel_error']:g}), "
                f"cosine {cosine:.6f} (at least {limit['cosine']:g})"
            )
    return problems
