"""Run time of the ``export`` backend: shipped in the wheel, so torch and the standard library only."""

import os

import torch


def load(name, entry, directory):
    return torch.export.load(os.path.join(directory, entry["file"])).module()
