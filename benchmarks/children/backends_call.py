"""Per-call microseconds of one model of an unpacked sample_project wheel, the best of 20 rounds of
2000 calls (run by benchmarks/backends.py).

Usage: ``backends_call.py SITE MODEL SAMPLE``, SAMPLE an expression of torch that makes the input.
"""

import sys
import time

import torch

site, model, sample = sys.argv[1:4]
sys.path.insert(0, site)
from sample_models import compiled

m, x = compiled.load(model), eval(sample, {"torch": torch})
best = 1e9
for _ in range(20):
    t = time.perf_counter()
    for _ in range(2000):
        m(x)
    best = min(best, (time.perf_counter() - t) / 2000)
print(best * 1e6)
