"""A minimal third-party hatch-aoti backend, registered through the ``hatch_aoti.backends`` entry point.

It ships the exported program itself (``torch.export.save``); its run-time module runs it
with ``torch.export.load``. No compiler at all: the point is the interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatch_aoti.backends import Backend, Request


class ExportBackend(Backend):
    name = "export"
    runtime = Path(__file__).with_name("runtime.py")
    in_helpers = True  # it needs only the exported program

    def compile(self, request: Request) -> dict[str, Any]:
        import torch

        from hatch_aoti.pipeline.artifacts import sha256

        request.out.mkdir(parents=True, exist_ok=True)
        path = request.out / "program.pt2"
        torch.export.save(request.exported, path)
        path.chmod(0o644)
        return {"file": path.name, "sha256": sha256(path)}
