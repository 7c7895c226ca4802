"""A build process hands freed memory back: large blocks are mapped on their own, so a stage's peak
does not count what an earlier stage freed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hatch_aoti.worker.bootstrap import _libc

#: Forty 6 MiB blocks, each followed by a small one that stays: glibc's heap cannot shrink past the
#: small ones, so the large ones, once freed, stay counted unless each was mapped on its own.
FRAGMENTED = """
import sys
from hatch_aoti.worker.bootstrap import hand_back_freed, large_blocks_mapped

if sys.argv[1] == "mapped":
    large_blocks_mapped()

def anonymous():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

first = b"x" * (6 << 20)
del first  # glibc raises its threshold to the largest block freed
before = anonymous()
blocks, kept = [], []
for _ in range(40):
    blocks.append(b"x" * (6 << 20))
    kept.append(b"y" * 100_000)
del blocks
if sys.argv[1] == "trimmed":
    hand_back_freed()
print((anonymous() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or _libc() is None, reason="glibc's malloc")
@pytest.mark.parametrize("how", ["mapped", "trimmed"])
def test_freed_large_blocks_are_handed_back_to_the_system(how: str) -> None:
    """Each way on its own: blocks mapped from the start (every process), or the heap trimmed (between stages)."""
    out = subprocess.run([sys.executable, "-c", FRAGMENTED, how], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 40, f"{out.stdout.strip()} MiB of 240 MiB freed still counted"
