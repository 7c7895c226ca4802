"""Load bigpkg's model from an unpacked wheel and call it once: seconds of `import torch` and of load and
call, peak, anonymous and file-backed RSS, and whether the weights file is mapped (run by benchmarks/big.py).

Usage: ``big_load.py SITE N [--hold SECONDS]``: with ``--hold``, then the process's PSS and RSS once
another process has loaded too, and it stays up SECONDS more.
"""

import sys
import time
from pathlib import Path

t0 = time.perf_counter()
import torch

t1 = time.perf_counter()
site, n = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, site)
from bigpkg import compiled

y = compiled.load("big")(torch.randn(1, n))
t2 = time.perf_counter()
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/, after the figures above
import common

status = common.status()
with open("/proc/self/maps") as f:
    maps = f.read()
print(t1 - t0, t2 - t1, status["VmHWM"], status["RssAnon"], status["RssFile"], "weights.bin" in maps)
if "--hold" in sys.argv:
    time.sleep(3)  # until the other process has loaded too
    with open("/proc/self/smaps_rollup") as f:
        pss = dict(line.split(":", 1) for line in f.read().splitlines()[1:])
    print("pss", int(pss["Pss"].split()[0]) * 1024, "rss", status["VmRSS"], flush=True)
    time.sleep(float(sys.argv[-1]))
