"""hatch-aoti: compile declared PyTorch models with AOTInductor during the wheel build."""

from __future__ import annotations

__version__ = "0.2.0"
