"""Real-size models built by hatch-aoti against eager, ONNX Runtime and OpenVINO, side by side, at each
precision each of them offers on this CPU.

BERT-base, GPT-2, ResNet-50 and ViT-base from transformers' default configs (seeded random
weights, batch 1, static shapes) are built into one wheel with hatch-aoti
(`python -m build --no-isolation`), each with `precision = ["bfloat16", "int8", "float32"]` where
hatch-aoti has the key, and installed into a directory of their own. One process then loads each
of the wheel's variants (`load(name, precision=p)` where the loader takes a precision; float32
alone where it does not), the eager models, ONNX Runtime sessions at float32 and dynamically
quantized to int8 (`quant_pre_process`, then `quantize_dynamic(weight_type=QInt8)`), and OpenVINO
compiled models forced to f32 and with its defaults (bf16 on a CPU with AVX512_BF16 or AMX), all
on one ONNX file per model (`torch.onnx.export(..., dynamo=True)` of the same eager module, so
every side runs the same weights) and at the same thread count, and times them in interleaved
rounds with `torch.utils.benchmark`. Each side's output on the timed input is compared with the
float32 eager model's, in float64: relative L2 error and cosine similarity.

It prints the CPU and whether it has avx512_bf16 and amx_bf16, the precision OpenVINO reports
that it ran, each model's times and errors, each side's time over hatch-aoti's float32 and its
fastest variant, the goals with their figures (hatch-aoti's fastest variant at 1.1x OpenVINO's
defaults on the geometric mean and none under 0.9x, 1.5x ONNX Runtime int8, 3x hatch-aoti
float32; each bfloat16 variant's error at most 1.25x OpenVINO's defaults', each int8 variant's at
most ONNX Runtime int8's), and each side's rate of floating-point work against the fastest fp32
matrix product of torch's libraries here.

Run with the test venv, which needs `transformers onnx onnxscript onnxruntime openvino` (the
`bench` extra) and `torchao` (the `test` extra) for the int8 variants:

    .venv-test/bin/python benchmarks/peers.py                # the defaults
    .venv-test/bin/python benchmarks/peers.py --models resnet50 --rounds 1   # a quick check
    .venv-test/bin/python benchmarks/peers.py --precision float32   # hatch-aoti's float32 alone
    .venv-test/bin/python benchmarks/peers.py --tune         # tune = true
    .venv-test/bin/python benchmarks/peers.py --optimize host  # compiled for this CPU
    .venv-test/bin/python benchmarks/peers.py --models bert,resnet50 --threads 2 --rounds 5
    # more architectures (transformers' default configs too): distilbert, t5encoder, whisperencoder,
    # convnext, swin, mobilenetv2, efficientnet
    .venv-test/bin/python benchmarks/peers.py --models convnext,swin,efficientnet
    # each model also built with other settings, timed beside the defaults as `against`:
    .venv-test/bin/python benchmarks/peers.py --against '{ "cpp.weight_prepack" = false }'
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from common import PROJECTS, build_wheel, cpu_flags, cpu_name, header, timed, unpack, write_package

#: Each model's input: shape, dtype and the end of its values' range (token ids; pixels from 0), from which
#: the build draws its inputs too (None: the build's normals, timed on [0, 1)).
INPUTS = {
    "bert": ([1, 128], "int64", 30522),
    "gpt2": ([1, 128], "int64", 50257),
    "resnet50": ([1, 3, 224, 224], "float32", 1),
    "vit": ([1, 3, 224, 224], "float32", 1),
    # not run unless named in --models:
    "distilbert": ([1, 128], "int64", 30522),
    "t5encoder": ([1, 128], "int64", 32128),
    "whisperencoder": ([1, 80, 3000], "float32", None),
    "convnext": ([1, 3, 224, 224], "float32", 1),
    "swin": ([1, 3, 224, 224], "float32", 1),
    "mobilenetv2": ([1, 3, 224, 224], "float32", 1),
    "efficientnet": ([1, 3, 224, 224], "float32", 1),
}
#: What runs without --models.
DEFAULT_MODELS = ["bert", "gpt2", "resnet50", "vit"]
#: hatch-aoti's precisions, in the order of preference the models declare them without --precision.
PRECISIONS = ["bfloat16", "int8", "float32"]
TABLE = """
[tool.hatch.build.targets.wheel.hooks.aoti]
tune = {tune}
optimize = "{optimize}"
"""
MODEL_TABLE = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.{name}]
factory = "peerpkg.models:{name}"
"""
INPUTS_LINE = 'inputs = [{{ shape = {shape}, dtype = "{dtype}"{high} }}]\n'
AGAINST = '\n[tool.hatch.build.targets.wheel.hooks.aoti.models.{name}_against]\nfactory = "peerpkg.models:{name}"\n'

#: The sides' names: hatch-aoti's are "hatch-aoti <precision>"; the peers' below.
EAGER, AGAINST_SIDE = "eager", "against"
ORT, ORT_INT8 = "onnxruntime", "onnxruntime int8"
OV_F32, OV_DEFAULT = "openvino f32", "openvino defaults"
#: The sides that compute in float32: the ones whose time is set against torch's fastest fp32 matrix product.
FP32_PEERS = (EAGER, ORT, OV_F32)
#: OpenVINO's execution graph: the layers whose precision says which one the model's work ran at.
OV_WORK = ("Convolution", "GroupConvolution", "FullyConnected", "MatMul", "ScaledDotProductAttention")


def aoti(precision: str) -> str:
    """The side of hatch-aoti's ``precision`` variant."""
    return f"hatch-aoti {precision}"


def precision_key() -> bool:
    """Whether this hatch-aoti's model tables take ``precision`` (its settings' schema says)."""
    try:
        from hatch_aoti.settings.schema import tool_schema

        return "precision" in tool_schema()["properties"]["models"]["additionalProperties"]["properties"]
    except (ImportError, KeyError, TypeError):
        return False


def build(
    models: list[str], tune: bool, optimize: str, against: str | None, work: Path, precisions: list[str] | None = None
) -> tuple[Path, float, str]:
    """The wheel of ``models`` (each with ``precisions`` where given, and each again at float32 with the
    ``against`` inductor-configs), unpacked into ``work/site``; the build's seconds and output."""
    project = work / "project"
    requires = ["torchao"] if precisions and "int8" in precisions else []
    tables = [header("peerpkg", *requires), TABLE.format(tune=str(tune).lower(), optimize=optimize)]
    for name in models:
        shape, dtype, high = INPUTS[name]
        inputs = INPUTS_LINE.format(shape=shape, dtype=dtype, high=f", high = {high}" if high else "")
        tables.append(MODEL_TABLE.format(name=name) + inputs)
        if precisions:
            tables.append(f"precision = {json.dumps(precisions)}\n")
        if precisions and "int8" in precisions and dtype == "float32" and shape[1:] == [3, 224, 224]:
            tables.append('calibration = "peerpkg.models:images"\n')  # the convolutions' ranges
        if against:
            tables.append(AGAINST.format(name=name) + f"{inputs}inductor-configs = {against}\n")
    write_package(project, "peerpkg", "peer_models.py")
    (project / "pyproject.toml").write_text("".join(tables), encoding="utf-8")
    env = {**os.environ, "HATCH_AOTI_NO_CACHE": "1"}
    wheel, seconds, log = build_wheel(project, work / "dist", env)
    return unpack(wheel, work / "site"), seconds, log


def eager(name: str) -> Any:
    """The eager model ``name`` as the wheel's factory makes it (``projects/peer_models.py``)."""
    if str(PROJECTS) not in sys.path:
        sys.path.append(str(PROJECTS))
    import peer_models

    return getattr(peer_models, name)()


def example(name: str) -> Any:
    import torch

    shape, dtype, high = INPUTS[name]
    generator = torch.Generator().manual_seed(7)
    if dtype == "int64":
        assert high is not None, "token ids need the vocabulary's size"
        return torch.randint(0, high, shape, generator=generator)
    return torch.rand(shape, generator=generator) * (high or 1)


def variants(compiled: Any, name: str, precisions: list[str] | None) -> tuple[dict[str, Callable[..., Any]], str]:
    """hatch-aoti's variants of ``name``, each as a side, loaded with ``load(name, precision=p)`` (float32
    alone, by ``load(name)``, where ``precisions`` is None); and the one the loader picks here."""
    if precisions is None:
        return {aoti("float32"): compiled.load(name)}, "float32 (no variants)"
    found = {}
    for precision in precisions:
        try:
            found[aoti(precision)] = compiled.load(name, precision=precision)
        except Exception as exc:  # a variant the wheel lacks, or this CPU cannot run
            print(f"  hatch-aoti has no {precision} variant of {name} here: {last_line(exc)}")
    return found, str(compiled.info(name).get("precision", "not said"))


def on(model: Callable[..., Any], x: Any) -> Callable[[], object]:
    """``model`` called on ``x``, as a call of no arguments."""
    return lambda: model(x)


class Peer(NamedTuple):
    """One peer's call on the example input, and what it says of the precision it runs at (or None)."""

    call: Callable[[], object]
    precision: str | None


def peers(name: str, module: Any, x: Any, threads: int, work: Path) -> dict[str, Peer]:
    """ONNX Runtime (float32 and int8) and OpenVINO (f32 and its defaults) on one ONNX export of
    ``module``, each called once; a peer that is missing, or cannot take the model, is left out of its
    row with the reason."""
    import torch

    path = work / f"{name}.onnx"
    try:
        with torch.no_grad():
            torch.onnx.export(module, (x,), str(path), dynamo=True, external_data=True)
    except Exception as exc:  # the exporter raises its own types; the row keeps eager and hatch-aoti
        print(f"  torch.onnx cannot export {name}: {last_line(exc)}")
        return {}
    starts: dict[str, Callable[[Path, Any, int], Peer]] = {
        ORT: onnxruntime_peer,
        ORT_INT8: onnxruntime_int8_peer,
        OV_F32: lambda path, x, threads: openvino_peer(path, x, threads, "f32"),
        OV_DEFAULT: lambda path, x, threads: openvino_peer(path, x, threads, None),
    }
    found: dict[str, Peer] = {}
    for side, start in starts.items():
        try:
            peer = start(path, x, threads)
            peer.call()
            found[side] = peer
        except ImportError as exc:
            print(f"  {side} left out: {exc}")
        except Exception as exc:  # each runtime raises its own types
            print(f"  {side} cannot run {name}: {last_line(exc)}")
    return found


def onnxruntime_peer(path: Path, x: Any, threads: int) -> Peer:
    """One ONNX Runtime session on ``path`` with every graph optimization, as a call on ``x``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x.numpy()}
    return Peer(lambda: session.run(None, feed), None)


def onnxruntime_int8_peer(path: Path, x: Any, threads: int) -> Peer:
    """ONNX Runtime on ``path`` quantized as its documentation says for dynamic quantization: the model
    prepared by ``quant_pre_process`` (shape inference and graph optimization), then its weights
    quantized to int8 by ``quantize_dynamic`` (activations quantized at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared, quantized = path.with_suffix(".pre.onnx"), path.with_suffix(".int8.onnx")
    quant_pre_process(str(path), str(prepared))
    quantize_dynamic(str(prepared), str(quantized), weight_type=QuantType.QInt8)
    prepared.unlink()
    return Peer(onnxruntime_peer(quantized, x, threads).call, "int8")


def openvino_peer(path: Path, x: Any, threads: int, precision: str | None) -> Peer:
    """One OpenVINO model on ``path``, compiled for latency at ``precision`` (its default where None),
    as a call on ``x``; the precision it reports, and its execution graph's count of layers by precision."""
    import openvino as ov

    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    model = ov.Core().compile_model(str(path), "CPU", config)
    request, array = model.create_infer_request(), x.numpy()
    return Peer(lambda: request.infer([array]), openvino_precision(model))


def openvino_precision(model: Any) -> str:
    """What an OpenVINO compiled model reports of its precision: its ``INFERENCE_PRECISION_HINT``, and
    how many of the execution graph's convolutions and matrix products run at each precision."""
    hint = model.get_property("INFERENCE_PRECISION_HINT").to_string()
    counts: collections.Counter[str] = collections.Counter()
    for op in model.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in OV_WORK:
            counts[info["runtimePrecision"].astype(str)] += 1
    layers = ", ".join(f"{n} {p}" for p, n in counts.most_common())
    return f"{hint} (INFERENCE_PRECISION_HINT; execution graph's convolutions and matrix products: {layers or 'none'})"


def last_line(exc: BaseException) -> str:
    """The last line of an error's message, or its type where it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[-1]


def wide(output: object) -> Any:
    """A side's (first) output as a flat float64 tensor: a tensor, an array, ONNX Runtime's list of
    arrays, OpenVINO's results."""
    import numpy as np
    import torch

    if hasattr(output, "to_tuple"):  # OpenVINO's OVDict
        output = output.to_tuple()
    while isinstance(output, (list, tuple)):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.detach().to(torch.float64).flatten()
    return torch.from_numpy(np.asarray(output, dtype=np.float64)).flatten()


def accuracy(output: object, reference: Any) -> tuple[float, float]:
    """Relative L2 error (||y - eager|| / ||eager||) and cosine similarity of ``output`` against the
    float64 ``reference``, in float64."""
    y = wide(output)
    if y.shape != reference.shape:
        raise ValueError(f"{y.numel()} values against eager's {reference.numel()}")
    error = float((y - reference).norm() / reference.norm())
    cosine = float(y.dot(reference) / (y.norm() * reference.norm()))
    return error, cosine


def flops(module: Any, x: Any) -> int:
    """The floating-point operations of one eager call, as torch counts them (matrix products,
    convolutions, attention)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(x)
    return int(counter.get_total_flops())


def peak(threads: int, n: int = 2048) -> float:
    """FLOP/s of torch's fastest fp32 matrix product here (MKL's, or oneDNN's on a packed weight, at n
    cubed): what a compiled model's multiply-adds run at, at best."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    calls: dict[str, Callable[[], object]] = {"mkl": lambda: torch.mm(a, b)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        calls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    return 2 * n**3 / min(timed(calls, threads, 2).values())


def rates(rows: list[tuple[str, dict[str, float]]], counts: dict[str, int], fastest: float) -> None:
    """Each side's GFLOP/s and share of ``fastest``; and each float32 peer's time over that of the same
    work at ``fastest``: the most a model on torch's float32 kernels could gain on that peer."""
    print(f"\nGFLOP/s (share of torch's fastest fp32 matrix product here, {fastest / 1e9:.0f} GFLOP/s)")
    bounds: dict[str, list[float]] = {}
    for name, medians in rows:
        rate = {k: counts[name] / v for k, v in medians.items()}
        each = ", ".join(f"{k} {r / 1e9:.0f} ({r / fastest:.0%})" for k, r in rate.items())
        print(f"  {name:9s} {counts[name] / 1e9:.1f} GFLOP a call: {each}")
        for peer, seconds in medians.items():
            if peer in FP32_PEERS:
                bounds.setdefault(peer, []).append(seconds / (counts[name] / fastest))
    for peer, values in bounds.items():
        print(f"  {peer} time / the time of its work at that rate: geomean {geomean(values):.2f}x")


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


class Row(NamedTuple):
    """What one model gave: each side's median seconds, relative error and cosine against eager."""

    ms: dict[str, float]
    error: dict[str, float]
    cosine: dict[str, float]


def speed_goal(
    label: str, rows: dict[str, Row], best: dict[str, str], side: str, goal: float, floor: float | None = None
) -> dict[str, Any]:
    """Prints one speed goal: ``side``'s time over hatch-aoti's fastest variant, each model and their
    geometric mean, against ``goal`` (and ``floor`` for each model); returns it for the JSON line."""
    ratios = {n: r.ms[side] / r.ms[best[n]] for n, r in rows.items() if side in r.ms and best[n] in r.ms}
    missing = [n for n in rows if n not in ratios]
    mean = geomean(list(ratios.values()))
    each = ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items())
    if missing:
        verdict = f"not measured ({side} missing for {', '.join(missing)})"
    else:
        met = mean >= goal and (floor is None or min(ratios.values()) >= floor)
        verdict = "met" if met else "not met"
    wanted = f">= {goal}x" + (f", none below {floor}x" if floor is not None else "")
    print(f"  vs {label}: geomean {mean:.2f}x ({each}); goal {wanted}: {verdict}")
    return {"geomean": mean, "each": ratios, "goal": goal, "floor": floor, "verdict": verdict}


def accuracy_goals(rows: dict[str, Row], precisions: list[str]) -> list[dict[str, Any]]:
    """Prints the accuracy goals: each bfloat16 variant's error at most 1.25x OpenVINO defaults', each
    int8 variant's at most ONNX Runtime int8's; returns them for the JSON line."""
    goals = []
    for precision, peer, factor in (("bfloat16", OV_DEFAULT, 1.25), ("int8", ORT_INT8, 1.0)):
        side = aoti(precision)
        for name, row in rows.items():
            if precision not in precisions or side not in row.error:
                verdict, line = "not measured", f"no {precision} variant"
            elif peer not in row.error:
                verdict, line = "not measured", f"{row.error[side]:.2e}, but {peer} did not run"
            else:
                bound = factor * row.error[peer]
                verdict = "met" if row.error[side] <= bound else "not met"
                times = f"{factor} x " if factor != 1.0 else ""
                line = f"{row.error[side]:.2e}; goal <= {times}{row.error[peer]:.2e} ({peer}) = {bound:.2e}"
            print(f"  {name:9s} {side}: {verdict} ({line})")
            goals.append({"model": name, "side": side, "against": peer, "factor": factor, "verdict": verdict})
    return goals


def ratio_table(rows: dict[str, Row], shown: Callable[[str, str], bool], base: Callable[[str], str]) -> None:
    """Each side's time over the time of side ``base(model)``, model by model and their geometric mean, for
    the sides ``shown(model, side)``."""
    ratios: dict[str, dict[str, float]] = {}
    for name, row in rows.items():
        if base(name) in row.ms:
            for side, seconds in row.ms.items():
                if shown(name, side):
                    ratios.setdefault(side, {})[name] = seconds / row.ms[base(name)]
    for side, values in ratios.items():
        each = ", ".join(f"{n} {r:.2f}x" for n, r in values.items())
        print(f"  {side:20s} geomean {geomean(list(values.values())):.2f}x  ({each})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"some of {', '.join(INPUTS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of at least 1 s a side (1: quick)")
    parser.add_argument(
        "--precision", default=",".join(PRECISIONS), help="hatch-aoti's variants, in order of preference"
    )
    parser.add_argument("--tune", action="store_true", help="build with tune = true")
    parser.add_argument("--optimize", choices=("portable", "host"), default="portable", help="the table's optimize")
    parser.add_argument("--against", help="inductor-configs (TOML inline table) of a second build of each model")
    args = parser.parse_args()
    models = list(dict.fromkeys(args.models.split(",")))  # each once
    if unknown := sorted(set(models) - set(INPUTS)):
        parser.error(f"unknown models: {', '.join(unknown)} (known: {', '.join(INPUTS)})")
    wanted = list(dict.fromkeys(args.precision.split(",")))
    if unknown := sorted(set(wanted) - set(PRECISIONS)):
        parser.error(f"unknown precisions: {', '.join(unknown)} (known: {', '.join(PRECISIONS)})")
    import torch

    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    native = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx512_bf16", "amx_bf16"))
    print(f"CPU: {cpu_name()} ({native}), {os.cpu_count()} cores; torch {torch.__version__}; {args.threads} thread(s)")
    precisions: list[str] | None = wanted if precision_key() else None
    with tempfile.TemporaryDirectory(prefix="hatch-aoti-peers-") as tmp:
        work = Path(tmp)
        site, seconds, log = build(models, args.tune, args.optimize, args.against, work, precisions)
        settings = f"tune = {str(args.tune).lower()}, optimize = {args.optimize}"
        settings += f", precision = {json.dumps(precisions)}" if precisions else ""
        settings += f"; against: inductor-configs = {args.against}" if args.against else ""
        print(f"built {len(models)} models in {seconds:.0f} s ({settings})")
        for line in log.splitlines():
            if line.startswith("aoti:") and any(w in line for w in ("tune", "candidate", "compiled", "precision")):
                print(f"  {line}")
        sys.path.insert(0, str(site))
        from peerpkg import compiled
        from peerpkg import models as eager_models

        if precisions is not None and "precision" not in inspect.signature(compiled.load).parameters:
            print("  the built loader's load() takes no precision: hatch-aoti's float32 alone is timed")
            precisions = None
        elif precisions is None:
            print("  this hatch-aoti builds no precision variants: hatch-aoti's float32 alone is timed")
        rows: dict[str, Row] = {}
        counts, picks, ov_precision = {}, {}, {}
        for name in models:
            x = example(name)
            module = getattr(eager_models, name)()
            counts[name] = flops(module, x)
            sides, picks[name] = variants(compiled, name, precisions)
            if not sides:
                sys.exit(f"hatch-aoti loaded no variant of {name}")
            with torch.no_grad():
                reference = wide(module(x))
                if aoti("float32") in sides:  # the build's own check, again on the timed input
                    torch.testing.assert_close(sides[aoti("float32")](x), module(x), rtol=1e-3, atol=1e-3)
            calls = {side: on(model, x) for side, model in sides.items()}
            if args.against:
                calls[AGAINST_SIDE] = on(compiled.load(f"{name}_against"), x)
            calls[EAGER] = on(module, x)
            found = peers(name, module, x, args.threads, work)
            calls.update({k: p.call for k, p in found.items()})
            ov_precision[name] = {k: p.precision for k, p in found.items() if k.startswith("openvino")}
            error, cosine = {}, {}
            with torch.inference_mode():
                for side, call in calls.items():
                    error[side], cosine[side] = accuracy(call(), reference)
            medians = timed(calls, args.threads, args.rounds)
            rows[name] = Row(medians, error, cosine)
            print(f"{name}: hatch-aoti's loader picks {picks[name]} here")
            for side, precision in ov_precision[name].items():
                print(f"  {side} ran {precision}")
            print(f"  {'side':20s} {'ms':>8s} {'rel. L2 error':>14s} {'cosine':>10s}")
            for side, s in medians.items():
                print(f"  {side:20s} {s * 1e3:8.1f} {error[side]:14.2e} {cosine[side]:10.6f}", flush=True)
        # hatch-aoti's fastest variant of each model.
        best = {n: min((k for k in r.ms if k.startswith("hatch-aoti ")), key=r.ms.__getitem__) for n, r in rows.items()}
        print("\nside time / hatch-aoti float32 time (above 1: hatch-aoti is faster)")
        ratio_table(rows, lambda name, side: not side.startswith("hatch-aoti "), lambda name: aoti("float32"))
        if any(b != aoti("float32") for b in best.values()):
            print("side time / hatch-aoti's fastest variant's time")
            ratio_table(rows, lambda name, side: side != best[name], best.__getitem__)
        print(f"\ngoals, against hatch-aoti's fastest variant ({', '.join(f'{n} {b}' for n, b in best.items())}):")
        goals = {
            "openvino defaults": speed_goal("OpenVINO defaults", rows, best, OV_DEFAULT, 1.1, 0.9),
            "onnxruntime int8": speed_goal("ONNX Runtime int8", rows, best, ORT_INT8, 1.5),
            "hatch-aoti float32": speed_goal("hatch-aoti float32", rows, best, aoti("float32"), 3.0),
        }
        if precisions is None:
            print("  (float32 alone: this hatch-aoti or its loader has no precision variants)")
        print("accuracy goals (relative L2 error against float32 eager, float64):")
        accuracy_goal = accuracy_goals(rows, precisions or ["float32"])
        if any("bf16" not in str(p.get(OV_DEFAULT, "")) for p in ov_precision.values()):
            print("  (OpenVINO's defaults did not run bf16 on every model: see each model's line)")
        fastest = peak(args.threads)
        rates([(n, r.ms) for n, r in rows.items()], counts, fastest)
        print(
            json.dumps(
                {
                    "cpu": cpu_name(),
                    "cpu_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni"}),
                    "threads": args.threads,
                    "tune": args.tune,
                    "optimize": args.optimize,
                    "against": args.against,
                    "precision": precisions,
                    "loader_picks": picks,
                    "openvino_precision": ov_precision,
                    "ms": {n: {k: v * 1e3 for k, v in r.ms.items()} for n, r in rows.items()},
                    "rel_error": {n: r.error for n, r in rows.items()},
                    "cosine": {n: r.cosine for n, r in rows.items()},
                    "fastest_variant": best,
                    "goals": goals,
                    "accuracy_goals": accuracy_goal,
                    "gflop": {n: c / 1e9 for n, c in counts.items()},
                    "peak_gflops": fastest / 1e9,
                }
            )
        )


if __name__ == "__main__":
    main()
