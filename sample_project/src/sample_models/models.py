"""Two small models with weights loaded from a checked-in file.

``build_mlp`` is the 128 -> 256 -> 10 MLP with a GELU; ``build_classifier`` is a tiny
convolutional classifier whose batch size varies at run time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

WEIGHTS = Path(__file__).with_name("weights.pt")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(128, 256)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Classifier(nn.Module):
    """Images (batch, 3, 16, 16) -> (logits, probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.pool(torch.relu(self.conv(images))).flatten(1)
        logits = self.head(features)
        return logits, logits.softmax(dim=-1)


def _load(module: nn.Module, prefix: str) -> nn.Module:
    state = torch.load(WEIGHTS, map_location="cpu", weights_only=True)
    module.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    return module.eval()


def build_mlp() -> MLP:
    return _load(MLP(), "mlp.")


def build_classifier() -> Classifier:
    return _load(Classifier(), "classifier.")
