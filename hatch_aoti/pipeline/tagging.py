"""The wheel's platform tag, read from the compiled libraries themselves.

The artifacts are native code linked against libtorch, not against the Python ABI, so
the tag is ``py3-none-<platform>``: one wheel serves every CPython that the pinned torch
supports. The platform part is the most compatible ``manylinux_2_X_<arch>`` whose
policy (auditwheel's own policy table) allows every versioned symbol the libraries
need from system libraries (GLIBC, GLIBCXX, CXXABI, GCC, ...), not the build machine's
glibc. Every ``NEEDED`` library must be on that policy's list or be shipped by torch
itself (``libtorch_cpu.so``, torch's own ``libgomp.so.1``, ...), with the symbol
versions we use.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.version import Version

_MACHINES = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64", "EM_PPC64": "ppc64le", "EM_S390": "s390x"}
#: The program interpreter is always there; auditwheel does not count it either.
_IMPLICIT = frozenset({"ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "ld64.so.2", "ld64.so.1"})


class TagError(Exception):
    """The libraries need something no manylinux policy allows."""


@dataclass
class ElfNeeds:
    """What one shared library asks of the system."""

    arch: str
    needed: set[str] = field(default_factory=set)
    versions: dict[str, set[str]] = field(default_factory=dict)
    """Versioned symbols needed, by library (``{"libc.so.6": {"GLIBC_2.34", ...}}``)."""


def elf_needs(path: Path) -> ElfNeeds:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    with path.open("rb") as f:
        elf = ELFFile(f)
        machine = elf["e_machine"]
        if machine not in _MACHINES:
            raise TagError(f"{path.name}: unsupported ELF machine {machine}")
        needs = ElfNeeds(_MACHINES[machine])
        for section in _sections(elf, ("SHT_DYNAMIC", "SHT_GNU_verneed")):
            if isinstance(section, DynamicSection):
                tags = [t for t in section.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
                needs.needed.update(t.needed for t in tags)  # type: ignore[attr-defined]
            elif isinstance(section, GNUVerNeedSection):
                for verneed, auxiliaries in section.iter_versions():
                    needs.versions.setdefault(str(verneed.name), set()).update(aux.name for aux in auxiliaries)
    return needs


def elf_provides(path: Path) -> tuple[str, set[str]]:
    """(SONAME, version definitions) of a library, e.g. torch's ``libgomp.so.1``."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerDefSection

    soname, defined = path.name, set[str]()
    with path.open("rb") as f:
        elf = ELFFile(f)
        for section in _sections(elf, ("SHT_DYNAMIC", "SHT_GNU_verdef")):
            if isinstance(section, DynamicSection):
                for tag in section.iter_tags():
                    if tag.entry.d_tag == "DT_SONAME":
                        soname = tag.soname  # type: ignore[attr-defined]
            elif isinstance(section, GNUVerDefSection):
                for _verdef, auxiliaries in section.iter_versions():
                    defined.update(aux.name for aux in auxiliaries)
    return soname, defined


#: What a model's library takes from libtorch by name: its C shim (versioned by suffix, ``_v2``) and Sleef.
#: Other unversioned symbols (the CUDA driver's, which torch opens at run time) are not libtorch's to check.
TORCH_SYMBOL_PREFIXES = ("aoti_torch_", "Sleef_")


def torch_symbols(path: Path) -> list[str]:
    """The symbols a model's library takes from libtorch: its undefined dynamic symbols without a
    version (the system libraries version theirs: ``GLIBC_2.34``, ``GOMP_4.0``) of libtorch's C shim
    and Sleef. The loader checks that the running torch has them."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerSymSection
    from elftools.elf.sections import SymbolTableSection

    found = []
    with path.open("rb") as f:
        elf = ELFFile(f)
        dynsym, versions = elf.get_section_by_name(".dynsym"), elf.get_section_by_name(".gnu.version")
        versions = versions if isinstance(versions, GNUVerSymSection) else None
        for index, symbol in enumerate(dynsym.iter_symbols() if isinstance(dynsym, SymbolTableSection) else ()):
            if not symbol.name or symbol["st_shndx"] != "SHN_UNDEF" or symbol["st_info"]["bind"] != "STB_GLOBAL":
                continue
            version = versions.get_symbol(index).entry["ndx"] if versions is not None else "VER_NDX_GLOBAL"
            if version in ("VER_NDX_GLOBAL", "VER_NDX_LOCAL") and symbol.name.startswith(TORCH_SYMBOL_PREFIXES):
                found.append(symbol.name)
    return sorted(found)


def _sections(elf: Any, types: tuple[str, ...]) -> Iterator[Any]:
    """Only the sections of these types: building every section of ``libtorch_cpu.so``
    (its symbol hash tables above all) costs more than the rest of the tagging."""
    from elftools.common.exceptions import ELFError

    for index in range(elf.num_sections()):
        try:
            yield elf.get_section(index, type=types)  # checks the header's type first
        except ELFError:
            continue


def torch_libraries(torch_lib_dir: Path, names: Iterable[str] | None = None) -> dict[str, set[str]]:
    """Libraries torch ships (``torch/lib``), by SONAME, with the symbol versions they define.

    ``names`` limits the search to those file names (the ``NEEDED`` entries in question):
    reading every library torch ships costs a noticeable part of a cached rebuild.
    """
    wanted = set(names) if names is not None else None
    provided: dict[str, set[str]] = {}
    for path in sorted(torch_lib_dir.glob("*.so*")):
        if path.is_file() and (wanted is None or path.name in wanted):
            try:
                soname, defined = elf_provides(path)
            except Exception:
                continue
            provided[soname] = defined
    return provided


def prepare() -> None:
    """Load what tagging needs (pyelftools, auditwheel's policy table) ahead of time.

    The hook runs this on a thread while the workers export and compile, so a cached
    rebuild does not wait for it at the end. Best effort: :func:`platform_tag` reports
    any problem itself.
    """
    try:
        import elftools.elf.dynamic
        import elftools.elf.elffile
        import elftools.elf.gnuversions  # noqa: F401

        _policies()
    except Exception:
        pass


@functools.lru_cache(maxsize=1)
def _policies() -> list[dict]:
    text = resources.files("auditwheel.policy").joinpath("manylinux-policy.json").read_text(encoding="utf-8")
    policies = [p for p in json.loads(text) if p["name"].startswith("manylinux_")]
    return sorted(policies, key=lambda p: -p["priority"])  # most compatible first


def _blockers(policy: dict, needs: ElfNeeds, provided: dict[str, set[str]]) -> list[str]:
    allowed_versions = policy["symbol_versions"].get(needs.arch)
    if not allowed_versions:
        return [f"{policy['name']} has no {needs.arch} variant"]
    whitelist = set(policy["lib_whitelist"])
    problems = []
    for lib in sorted(needs.needed - _IMPLICIT):
        if lib in whitelist:
            for version in sorted(needs.versions.get(lib, ())):
                prefix, _, number = version.partition("_")
                if number not in allowed_versions.get(prefix, ()):
                    problems.append(f"{lib} {version}")
        elif lib in provided:
            missing = needs.versions.get(lib, set()) - provided[lib]
            if missing:
                problems.append(f"torch's {lib} lacks {', '.join(sorted(missing))}")
        else:
            problems.append(f"{lib} (neither allowed by manylinux nor shipped by torch)")
    return problems


def platform_tag(libraries: Iterable[Path], torch_lib_dir: Path) -> tuple[str, str | None]:
    """The most compatible ``manylinux_2_X_<arch>`` tag allowing every library's needs.

    Returns ``(tag, None)``, or ``("linux_<arch>", why)`` when no manylinux policy fits
    (a CUDA build linking libraries that come from other packages, say): still honest,
    just not uploadable to PyPI.
    """
    merged: ElfNeeds | None = None
    for library in libraries:
        needs = elf_needs(library)
        if merged is None:
            merged = needs
        elif needs.arch != merged.arch:
            raise TagError(f"compiled libraries disagree on architecture: {merged.arch} and {needs.arch}")
        else:
            merged.needed |= needs.needed
            for lib, versions in needs.versions.items():
                merged.versions.setdefault(lib, set()).update(versions)
    if merged is None:
        raise TagError("no compiled library to tag")
    return tag_for(merged, torch_libraries(torch_lib_dir, merged.needed))


def tag_for(needs: ElfNeeds, provided: dict[str, set[str]]) -> tuple[str, str | None]:
    """:func:`platform_tag` for needs already read (and merged) from the libraries."""
    last: list[str] = []
    for policy in _policies():
        last = _blockers(policy, needs, provided)
        if not last:
            return f"{policy['name']}_{needs.arch}", None
    return f"linux_{needs.arch}", "no manylinux policy allows " + "; ".join(last)


def torch_platform() -> str:
    """The platform tag of the installed torch's own wheel (``linux_<arch>`` if it does not say)."""
    import importlib.metadata
    import os

    try:
        wheel = importlib.metadata.distribution("torch").read_text("WHEEL") or ""
    except importlib.metadata.PackageNotFoundError:
        wheel = ""
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    return tags[0].split("-")[-1] if tags else f"linux_{os.uname().machine}"


def torch_series(torch_version: str) -> str:
    """``torch==X.Y.*``: the artifacts are tied to libtorch's ABI of one release series."""
    release = Version(torch_version).release
    return f"torch=={release[0]}.{release[1]}.*"
