"""Real-size models built by hatch-aoti against eager, ONNX Runtime and OpenVINO, side by side.

BERT-base, GPT-2, ResNet-50 and ViT-base from transformers' default configs (seeded random
weights, batch 1, static shapes) are built into one wheel with hatch-aoti
(`python -m build --no-isolation`) and installed into a directory of their own. One process
then loads the compiled models, the eager models, ONNX Runtime sessions and OpenVINO compiled
models of one ONNX file per model (`torch.onnx.export(..., dynamo=True)` of the same eager
module, so every side runs the same weights), all at the same thread count, and times them in
interleaved rounds with `torch.utils.benchmark`. It prints each ratio and their geometric means,
and each side's rate of floating-point work against the fastest fp32 matrix product of torch's
libraries here: how far a model compiled to torch's kernels is from their limit.

Run with the test venv, which needs `transformers onnx onnxscript onnxruntime` (and `openvino`
for the second peer):

    .venv-test/bin/python benchmarks/peers.py                # the defaults
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
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import HEADER, PROJECTS, build_wheel, cpu_name, timed, unpack, write_package

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
TABLE = """
[tool.hatch.build.targets.wheel.hooks.aoti]
tune = {tune}
optimize = "{optimize}"
"""
MODEL_TABLE = """
[tool.hatch.build.targets.wheel.hooks.aoti.models.{name}]
factory = "peerpkg.models:{name}"
inputs = [{{ shape = {shape}, dtype = "{dtype}"{high} }}]
"""
AGAINST = '\n[tool.hatch.build.targets.wheel.hooks.aoti.models.{name}_against]\nfactory = "peerpkg.models:{name}"\n'


def build(models: list[str], tune: bool, optimize: str, against: str | None, work: Path) -> tuple[Path, float, str]:
    """The wheel of ``models`` (and each again with the ``against`` inductor-configs), unpacked into
    ``work/site``; the build's seconds and output."""
    project = work / "project"
    tables = [HEADER.format(name="peerpkg"), TABLE.format(tune=str(tune).lower(), optimize=optimize)]
    for name in models:
        shape, dtype, high = INPUTS[name]
        table = MODEL_TABLE.format(name=name, shape=shape, dtype=dtype, high=f", high = {high}" if high else "")
        tables.append(table)
        if against:
            inputs = table.splitlines()[-1]
            tables.append(AGAINST.format(name=name) + f"{inputs}\ninductor-configs = {against}\n")
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


def peers(name: str, module: Any, x: Any, threads: int, work: Path) -> dict[str, Callable[[], object]]:
    """ONNX Runtime and OpenVINO callables on one ONNX export of ``module``, each called once; a peer
    that is missing, or cannot take the model, is left out of its row with the reason."""
    import torch

    path = work / f"{name}.onnx"
    try:
        with torch.no_grad():
            torch.onnx.export(module, (x,), str(path), dynamo=True, external_data=True)
    except Exception as exc:  # the exporter raises its own types; the row keeps eager and hatch-aoti
        print(f"  torch.onnx cannot export {name}: {last_line(exc)}")
        return {}
    found: dict[str, Callable[[], object]] = {}
    for peer, start in (("onnxruntime", onnxruntime_call), ("openvino", openvino_call)):
        try:
            call = start(path, x, threads)
            call()
            found[peer] = call
        except ImportError as exc:
            print(f"  {peer} left out: {exc}")
        except Exception as exc:  # each runtime raises its own types
            print(f"  {peer} cannot run {name}: {last_line(exc)}")
    return found


def onnxruntime_call(path: Path, x: Any, threads: int) -> Callable[[], object]:
    """One ONNX Runtime session on ``path`` with every graph optimization, as a call on ``x``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x.numpy()}
    return lambda: session.run(None, feed)


def openvino_call(path: Path, x: Any, threads: int) -> Callable[[], object]:
    """One OpenVINO model on ``path``, compiled for latency at f32, as a call on ``x``."""
    import openvino as ov

    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads}
    request, array = ov.Core().compile_model(str(path), "CPU", config).create_infer_request(), x.numpy()
    return lambda: request.infer([array])


def last_line(exc: BaseException) -> str:
    """The last line of an error's message, or its type where it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[-1]


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
    """Each side's GFLOP/s and share of ``fastest``; and each peer's time over that of the same work
    at ``fastest``: the most a model on torch's kernels could gain on that peer."""
    print(f"\nGFLOP/s (share of torch's fastest fp32 matrix product here, {fastest / 1e9:.0f} GFLOP/s)")
    bounds: dict[str, list[float]] = {}
    for name, medians in rows:
        rate = {k: counts[name] / v for k, v in medians.items()}
        each = ", ".join(f"{k} {r / 1e9:.0f} ({r / fastest:.0%})" for k, r in rate.items())
        print(f"  {name:9s} {counts[name] / 1e9:.1f} GFLOP a call: {each}")
        for peer, seconds in medians.items():
            if peer not in ("compiled", "against"):
                bounds.setdefault(peer, []).append(seconds / (counts[name] / fastest))
    for peer, values in bounds.items():
        print(f"  {peer} time / the time of its work at that rate: geomean {geomean(values):.2f}x")


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"some of {', '.join(INPUTS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tune", action="store_true", help="build with tune = true")
    parser.add_argument("--optimize", choices=("portable", "host"), default="portable", help="the table's optimize")
    parser.add_argument("--against", help="inductor-configs (TOML inline table) of a second build of each model")
    args = parser.parse_args()
    models = list(dict.fromkeys(args.models.split(",")))  # each once
    if unknown := sorted(set(models) - set(INPUTS)):
        parser.error(f"unknown models: {', '.join(unknown)} (known: {', '.join(INPUTS)})")
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; {args.threads} thread(s)")
    with tempfile.TemporaryDirectory(prefix="hatch-aoti-peers-") as tmp:
        work = Path(tmp)
        site, seconds, log = build(models, args.tune, args.optimize, args.against, work)
        settings = f"tune = {str(args.tune).lower()}, optimize = {args.optimize}"
        settings += f"; against: inductor-configs = {args.against}" if args.against else ""
        print(f"built {len(models)} models in {seconds:.0f} s ({settings})")
        for line in log.splitlines():
            if line.startswith("aoti:") and any(w in line for w in ("tune", "candidate", "compiled")):
                print(f"  {line}")
        sys.path.insert(0, str(site))
        from peerpkg import compiled
        from peerpkg import models as eager_models

        ratios: dict[str, dict[str, float]] = {}
        rows, counts = [], {}
        for name in models:
            x = example(name)
            module = getattr(eager_models, name)()
            model, counts[name] = compiled.load(name), flops(module, x)
            with torch.no_grad():
                torch.testing.assert_close(model(x), module(x), rtol=1e-3, atol=1e-3)
            other = compiled.load(f"{name}_against") if args.against else None
            calls = {
                "compiled": lambda model=model, x=x: model(x),  # type: ignore[misc]
                **({"against": lambda other=other, x=x: other(x)} if other else {}),  # type: ignore[misc]
                "eager": lambda module=module, x=x: module(x),  # type: ignore[misc]
                **peers(name, module, x, args.threads, work),
            }
            medians = timed(calls, args.threads, args.rounds)
            rows.append((name, medians))
            for peer, seconds in medians.items():
                if peer != "compiled":
                    ratios.setdefault(peer, {})[name] = seconds / medians["compiled"]
            line = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items())
            print(f"{name:9s} {line}", flush=True)
        print("\npeer time / compiled time (above 1: hatch-aoti is faster)")
        for peer, values in ratios.items():
            each = ", ".join(f"{n} {r:.2f}x" for n, r in values.items())
            print(f"  {peer:12s} geomean {geomean(list(values.values())):.2f}x  ({each})")
        fastest = peak(args.threads)
        rates(rows, counts, fastest)
        print(
            json.dumps(
                {
                    "cpu": cpu_name(),
                    "threads": args.threads,
                    "tune": args.tune,
                    "optimize": args.optimize,
                    "against": args.against,
                    "ms": {n: {k: v * 1e3 for k, v in m.items()} for n, m in rows},
                    "geomean": {p: geomean(list(v.values())) for p, v in ratios.items()},
                    "gflop": {n: c / 1e9 for n, c in counts.items()},
                    "peak_gflops": fastest / 1e9,
                }
            )
        )


if __name__ == "__main__":
    main()
