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
import subprocess
import sys
import tempfile

CHILD = """
import sys, torch, torch._inductor
from torch import nn
from torch.utils.benchmark import Timer

name, mode, work = sys.argv[1:4]
torch.manual_seed(0)
torch.set_num_threads(2)
def relu(*layers):
    return [m for layer in layers for m in (layer, nn.ReLU())]

if name == "mixed":  # one 3x3 convolution, eight linear layers
    body = [*relu(nn.Conv2d(3, 8, 3)), nn.AdaptiveAvgPool2d(4), nn.Flatten()]
    body += relu(nn.Linear(128, 256), *[nn.Linear(256, 256) for _ in range(6)])
else:  # four 3x3 convolutions, four linear layers
    body = relu(nn.Conv2d(3, 16, 3, padding=1), *[nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)])
    body += [nn.AdaptiveAvgPool2d(4), nn.Flatten(), *relu(*[nn.Linear(256, 256) for _ in range(3)])]
model = nn.Sequential(*body, nn.Linear(256, 10)).eval()
x = torch.rand(1, 3, 32, 32)
with torch.no_grad():
    call = model
    if mode != "eager":
        configs = {"freezing": True, "cpp.weight_prepack": mode == "packed"}
        program = torch.export.export(model, (x,))
        path = f"{work}/{name}-{mode}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)
        call = torch._inductor.aoti_load_package(path)
    torch.testing.assert_close(call(x), model(x), rtol=1e-4, atol=1e-4)
    timer = Timer("call(x)", globals={"call": call, "x": x}, num_threads=2)
    print(timer.blocked_autorange(min_run_time=3).median)
"""


def timed(name: str, mode: str, work: str) -> float:
    """Seconds per call of one model, compiled one way (or eager), in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", CHILD, name, mode, work], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} {mode} failed:\n{proc.stderr[-4000:]}")
    return float(proc.stdout.split()[-1])


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
