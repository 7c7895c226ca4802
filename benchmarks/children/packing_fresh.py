"""One model of peerpkg's wheel loaded and called once in a fresh process, under the environment's
``HATCH_AOTI_PACK``: the seconds, and the anonymous and file-backed memory it added, in MiB (run by
benchmarks/packing.py).

Usage: ``packing_fresh.py SITE NAME THREADS``.
"""

import json
import sys
import time
from pathlib import Path

site, name, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path[:0] = [site, str(Path(__file__).resolve().parents[1])]  # the wheel; benchmarks/: common, peers
import common
import peers
import torch

torch.set_num_threads(threads)
from peerpkg import compiled

x = peers.example(name)
before, start = common.status(), time.perf_counter()
compiled.load(name)(x)
seconds, after = time.perf_counter() - start, common.status()
print(
    json.dumps(
        {
            "seconds": seconds,
            "anon_mib": (after["RssAnon"] - before["RssAnon"]) / 2**20,
            "file_mib": (after["RssFile"] - before["RssFile"]) / 2**20,
        }
    )
)
