"""One linear layer's matrix product through each library a CPU model may run it on, side by side.

Times ``x @ w.T + b`` for the shapes of BERT-base (128 rows) and ViT-base (197 rows): through MKL
(``torch.addmm``, what eager and unpacked compiled models call), oneDNN on the dense weight and on
the weight packed for this CPU (``mkldnn._linear_pointwise``, what prepacked models call), and
ONNX Runtime's ``Gemm`` (MLAS), all at the same thread count, and prints GFLOP/s:

    .venv-test/bin/python benchmarks/gemm.py --threads 2
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from common import cpu_name, timed

SHAPES = [(rows, k, n) for rows in (128, 197) for k, n in ((768, 768), (768, 3072), (3072, 768))]


def onnxruntime_gemm(w: Any, b: Any, rows: int, threads: int) -> Any:
    """An ONNX Runtime session of one ``Gemm`` by ``w`` (out, in) plus ``b``, or None without it."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    k, n = w.shape[1], w.shape[0]
    weights = [numpy_helper.from_array(w.t().contiguous().numpy(), "W"), numpy_helper.from_array(b.numpy(), "B")]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W", "B"], ["Y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [rows, n])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def calls(rows: int, k: int, n: int, threads: int) -> dict[str, Callable[[], object]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=generator) for shape in ((rows, k), (n, k), (n,)))
    linear = torch.ops.mkldnn._linear_pointwise
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    found: dict[str, Callable[[], object]] = {
        "mkl": lambda: torch.addmm(b, x, w.t()),
        "onednn": lambda: linear(x, w, b, "none", [], ""),
        "onednn packed": lambda: linear(x, packed, b, "none", [], ""),
    }
    session, array = onnxruntime_gemm(w, b, rows, threads), x.numpy()
    if session is not None:
        found["onnxruntime"] = lambda: session.run(None, {"X": array})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; {args.threads} thread(s)")
    for rows, k, n in SHAPES:
        medians = timed(calls(rows, k, n, args.threads), args.threads, args.rounds)
        rates = ", ".join(f"{lib} {2 * rows * k * n / s / 1e9:.0f}" for lib, s in medians.items())
        print(f"{rows} x {k} by {k} x {n}: GFLOP/s {rates}", flush=True)


if __name__ == "__main__":
    main()
