"""Prepacking a model of small convolutions and small linear layers: packed against not, and eager.

Each model is compiled with AOTInductor (``freezing``, ``cpp.weight_prepack`` on and off, as the
aoti backend's fast defaults set them) in a process of its own, since Inductor registers its
packing passes once per process, and timed with ``torch.utils.benchmark`` after matching eager.
``mixed``: one 3x3 convolution (3 to 8 channels, 32x32) before eight linear layers
(128 to 256, six 256 to 256, 256 to 10); ``balanced``: four 3x3 convolutions (16 channels) and four
linear layers (three 256 to 256, 256 to 10), a ReLU after each layer but the last. Run with the test venv:

    .venv-test/bin/python benchmarks/mixed.py --rounds 2
"""

from __future__ import annotations

import argparse
import tempfile

from common import run_child


def timed(name: str, mode: str, work: str) -> float:
    """Seconds per call of one model, compiled one way (or eager), in a fresh process."""
    return float(run_child("mixed_model", name, mode, work, failure=f"{name} {mode} failed").split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for name in ("mixed", "balanced"):
            for _ in range(args.rounds):
                us = {mode: timed(name, mode, work) * 1e6 for mode in ("eager", "unpacked", "packed")}
                cells = "  ".join(f"{mode} {value:7.1f} us" for mode, value in us.items())
                print(f"{name:9} {cells}  packed/unpacked {us['packed'] / us['unpacked']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
