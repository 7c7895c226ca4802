"""The model of benchmarks/big.py's wheel: 4 x Linear(N, N) (copied in as bigpkg/models.py, N set by --n)."""

import torch
from torch import nn

N = 8192


def build():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(N, N) for _ in range(4)]).eval()
