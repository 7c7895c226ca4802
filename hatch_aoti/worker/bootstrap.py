"""What every worker process does first, before any of the project's code runs."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

from hatch_aoti.pipeline.protocol import HelperJob, Job
from hatch_aoti.store.cache import BYTECODE_DIR


def setup(job: Job | HelperJob) -> None:
    """The project's import paths, the bytecode store, freed memory handed back, torch."""
    large_blocks_mapped()
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


#: glibc's ``mallopt`` parameter for the size from which a block is mapped on its own.
M_MMAP_THRESHOLD = -3
#: Blocks of this size and more are mapped on their own, and unmapped when freed.
MAPPED_FROM = 4 << 20


def _libc() -> object | None:
    """The C library's functions, where it is glibc (``mallopt`` and ``malloc_trim``); else ``None``."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def large_blocks_mapped() -> None:
    """Blocks of 4 MiB and more get pages of their own, handed back to the system once freed. glibc
    raises that threshold to the largest block freed, up to 32 MiB: the weights that Inductor serialises
    one by one (tens of MiB each for a large model) then leave freed blocks in the heap (about 170 MiB
    for a 1.1B-parameter model), counted in the build's peak. Nothing where the C library is not glibc."""
    libc: Any = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)


def hand_back_freed() -> None:
    """Collect garbage and hand the heap's free pages back to the system (glibc's ``malloc_trim``), between
    a build's stages: what one stage freed is then not counted again in the next one's peak."""
    gc.collect()
    libc: Any = _libc()
    if libc is not None:
        libc.malloc_trim(0)
