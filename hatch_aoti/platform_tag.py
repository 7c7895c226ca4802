"""The wheel's platform tag, read from the compiled libraries themselves.

The artifacts are native code linked against libtorch, not against the Python ABI, so
the tag is ``py3-none-<platform>``: one wheel serves every CPython that the pinned
torch supports. The platform part is ``manylinux_2_X_<arch>`` with X the newest glibc
symbol version the shipped libraries need, not the build machine's glibc.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from packaging.version import Version

_GLIBC = re.compile(r"^GLIBC_(\d+)\.(\d+)(?:\.\d+)?$")
_MACHINES = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64", "EM_PPC64": "ppc64le", "EM_S390": "s390x"}
#: manylinux2014; torch itself needs newer, so nothing older is worth claiming.
MIN_GLIBC = (2, 17)


def elf_requirements(path: Path) -> tuple[str, tuple[int, int]]:
    """(architecture, newest GLIBC_x.y version needed) of one shared library."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    with path.open("rb") as f:
        elf = ELFFile(f)
        machine = elf["e_machine"]
        if machine not in _MACHINES:
            raise ValueError(f"{path.name}: unsupported ELF machine {machine}")
        newest = MIN_GLIBC
        for section in elf.iter_sections():
            if not isinstance(section, GNUVerNeedSection):
                continue
            for _verneed, auxiliaries in section.iter_versions():
                for aux in auxiliaries:
                    match = _GLIBC.match(aux.name)
                    if match:
                        newest = max(newest, (int(match[1]), int(match[2])))
    return _MACHINES[machine], newest


def platform_tag(libraries: Iterable[Path]) -> str:
    """``manylinux_2_X_<arch>`` covering every library; all must share one architecture."""
    arches: set[str] = set()
    newest = MIN_GLIBC
    for library in libraries:
        arch, glibc = elf_requirements(library)
        arches.add(arch)
        newest = max(newest, glibc)
    if len(arches) != 1:
        raise ValueError(f"compiled libraries disagree on architecture: {sorted(arches) or 'none found'}")
    return f"manylinux_{newest[0]}_{newest[1]}_{arches.pop()}"


def torch_requirement(torch_version: str) -> str:
    """``torch==X.Y.*``: the artifacts are tied to libtorch's ABI of one release series."""
    release = Version(torch_version).release
    return f"torch=={release[0]}.{release[1]}.*"
