"""A fresh process's first ``compiled.load`` of llmpkg's model and its first call: seconds of each, and
the process's RSS before and after, in bytes; the logits saved to OUT (run by benchmarks/llm.py).

Usage: ``llm_fetch.py SITE OUT``; the weights cache is the environment's ``HATCH_AOTI_WEIGHTS_CACHE``.
"""

import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
import common

site, out = sys.argv[1:3]
sys.path.insert(0, site)
import torch
from llmpkg import compiled


def rss() -> dict[str, int]:
    return {k: v for k, v in common.status().items() if k.startswith("Rss")}


ids = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1))
before = rss()
start = time.perf_counter()
model = compiled.load("llama")
loaded = time.perf_counter() - start
start = time.perf_counter()
y = model(ids)
call = time.perf_counter() - start
torch.save(y, out)
print(json.dumps({"load": loaded, "first_call": call, "rss": rss(), "rss_torch": before}))
