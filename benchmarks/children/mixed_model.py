"""One model of benchmarks/mixed.py compiled one way (or eager) in this fresh process, checked against
eager and timed: seconds per call (Inductor registers its packing passes once per process).

Usage: ``mixed_model.py mixed|balanced eager|unpacked|packed WORK``.
"""

import sys
from typing import Any

import torch
import torch._inductor
from torch import nn
from torch.utils.benchmark import Timer

name, mode, work = sys.argv[1:4]
torch.manual_seed(0)
torch.set_num_threads(2)


def relu(*layers: nn.Module) -> list[nn.Module]:
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
    call: Any = model
    if mode != "eager":
        configs = {"freezing": True, "cpp.weight_prepack": mode == "packed"}
        program = torch.export.export(model, (x,))
        path = f"{work}/{name}-{mode}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)
        call = torch._inductor.aoti_load_package(path)
    torch.testing.assert_close(call(x), model(x), rtol=1e-4, atol=1e-4)
    timer = Timer("call(x)", globals={"call": call, "x": x}, num_threads=2)
    print(timer.blocked_autorange(min_run_time=3).median)
