"""Seconds to import torch, and the process's peak RSS after it, in bytes (run by benchmarks/big.py)."""

import sys
import time
from pathlib import Path

t = time.perf_counter()
import torch  # noqa: F401

seconds = time.perf_counter() - t
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/, after the figures above
import common

print(seconds, common.status()["VmHWM"])
