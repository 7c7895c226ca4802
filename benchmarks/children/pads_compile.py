"""transformers' MobileNetV2 of benchmarks/peers.py exported and compiled with the ``aoti`` backend's
fast defaults into PATH, its zero pads folded into the convolutions or not; prints how many pads the
program has and how many were folded (run by benchmarks/pads.py).

Usage: ``pads_compile.py folded|as-is PATH``.
"""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/: peers
import peers
import torch
import torch._inductor

from hatch_aoti.backends.aoti import FAST_DEFAULTS
from hatch_aoti.backends.rewrites import zero_pads_into_convolutions

model, x = peers.eager("mobilenetv2"), peers.example("mobilenetv2")
folded, path = sys.argv[1] == "folded", sys.argv[2]
program = torch.export.export(model, (x,))
PADS = (torch.ops.aten.pad.default, torch.ops.aten.constant_pad_nd.default)
pads = sum(n.target in PADS for n in program.graph.nodes)
count = zero_pads_into_convolutions(program) if folded else 0
with torch.no_grad():
    configs = {**FAST_DEFAULTS, "cpp.dynamic_threads": True}
    torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)
print(pads, count)
