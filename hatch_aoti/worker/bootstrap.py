"""What every worker process does first, before any of the project's code runs."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

from hatch_aoti.pipeline.protocol import HelperJob, Job
from hatch_aoti.store.cache import BYTECODE_DIR


def setup(job: Job | HelperJob) -> None:
    """The project's import paths, the bytecode store, torch."""
    for entry in reversed(job.sys_path):
        sys.path.insert(0, entry)
    if job.cache:
        from hatch_aoti.worker.bytecode import install

        install(Path(job.cache) / BYTECODE_DIR)
    preload_torch()


def preload_torch() -> None:
    """Import torch and its export machinery with the cycle collector paused: these imports build a
    large, long-lived graph and almost no garbage, so collecting during them is wasted (see
    ``benchmarks/build.py``). The imported objects are then frozen out of later collections."""
    gc.disable()
    try:
        import torch  # noqa: F401

        from hatch_aoti._torch_private import preload_export

        preload_export()
    finally:
        gc.freeze()
        gc.enable()
