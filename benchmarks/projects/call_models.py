"""The models of benchmarks/calls.py's wheel, one for each call structure (copied in as callbench/models.py)."""

import torch
from torch import nn


class Positional(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x, y):
        return self.lin(x) + y


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x, *, scale, **extra):
        return self.lin(x) * scale + extra["bias"]


class Nested(nn.Module):
    def forward(self, xs, parts):
        return (xs[0] + xs[1]) * parts["a"] - parts["b"]


class DictOut(nn.Module):
    def forward(self, x):
        return {"y": x.relu(), "norm": x.norm(dim=-1), "n": x.shape[0]}


def positional():
    torch.manual_seed(0)
    return Positional()


def keyword_only():
    torch.manual_seed(0)
    return KeywordOnly()


def nested():
    return Nested()


def dict_out():
    return DictOut()


def keyword_samples():
    return ((torch.randn(4, 16),), {"scale": torch.randn(4, 1), "bias": torch.randn(8)})


def nested_samples():
    return (([torch.randn(4, 8), torch.randn(4, 8)], {"a": torch.randn(8), "b": torch.randn(8)}), {})
