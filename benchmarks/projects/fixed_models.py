"""The model of benchmarks/llm.py's second wheel, with next to no weights: what torch and the compile
stack cost a build alone (copied in as fixedpkg/models.py)."""

import torch


def tiny():
    return torch.nn.Linear(8, 8, dtype=torch.bfloat16).eval()
