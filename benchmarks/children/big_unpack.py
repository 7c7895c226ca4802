"""The RSS that unpacking a ``.pt2`` (the staging of its weights for mapping) adds to a process that
has imported torch, in bytes (run by benchmarks/big.py).

Usage: ``big_unpack.py PT2 OUT``.
"""

import sys
from pathlib import Path

import torch  # noqa: F401  (as in the build's worker: the RSS before is torch's)

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
import common

from hatch_aoti.backends.pt2 import unpack_pt2

peak = common.PeakRss()
start = peak.peak
unpack_pt2(Path(sys.argv[1]), Path(sys.argv[2]))
print(peak.peak - start)
