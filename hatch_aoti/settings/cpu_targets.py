"""CPU targets: which instruction sets compiled CPU code may use.

AOTInductor compiles for the build machine by default (``-march=native`` and the widest
vector ISA found), so a wheel built on an AVX-512 machine dies with SIGILL on an AVX2
one. A target pins both the compiler's ``-march`` and Inductor's vector width, and names
the CPU features a machine needs to run the result; the loader checks them before it
loads anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# /proc/cpuinfo flag names of the x86-64 micro-architecture levels.
X86_64_V2 = ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")
X86_64_V3 = X86_64_V2 + ("abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")
X86_64_V4 = X86_64_V3 + ("avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")
#: Features a `native` build may use beyond the levels above.
X86_EXTRA = ("avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")
ARM_FEATURES = ("asimd", "asimddp", "bf16", "i8mm", "sve", "sve2")


@dataclass(frozen=True)
class CpuTarget:
    name: str
    arch: str
    """``os.uname().machine`` of the machines it runs on."""
    inductor_configs: dict[str, Any] = field(default_factory=dict)
    features: tuple[str, ...] = ()
    """CPU flags (as /proc/cpuinfo names them) a machine must have."""


def _configs(march: str, simdlen: int) -> dict[str, Any]:
    # The target names the vector ISA, so Inductor's probe of the compiler for every ISA
    # the CPU has (test programs built at each compile's start) is skipped.
    return {"cpp.march": march, "cpp.simdlen": simdlen, "cpp.vec_isa_ok": True}


TARGETS = {
    "x86-64-v3": CpuTarget("x86-64-v3", "x86_64", _configs("x86-64-v3", 256), X86_64_V3),
    "x86-64-v4": CpuTarget("x86-64-v4", "x86_64", _configs("x86-64-v4", 512), X86_64_V4),
    "armv8-a": CpuTarget("armv8-a", "aarch64", _configs("armv8-a", 128), ("asimd",)),
}
NATIVE = "native"
CHOICES = (*TARGETS, NATIVE)
#: Inductor settings a target owns; setting them in `inductor-configs` too is a conflict.
OWNED_CONFIGS = ("cpp.march", "cpp.simdlen")


def default_target(machine: str | None = None) -> str:
    """A portable baseline where one is known, else the build machine."""
    machine = machine or os.uname().machine
    return {"x86_64": "x86-64-v3", "aarch64": "armv8-a"}.get(machine, NATIVE)


def host_flags() -> set[str]:
    """This machine's CPU flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve(name: str, machine: str | None = None, flags: set[str] | None = None) -> CpuTarget:
    """The target to build with; `native` records what this machine has and may be used."""
    machine = machine or os.uname().machine
    if name != NATIVE:
        return TARGETS[name]
    flags = host_flags() if flags is None else flags
    known = X86_64_V4 + X86_EXTRA if machine == "x86_64" else ARM_FEATURES
    return CpuTarget(NATIVE, machine, {}, tuple(sorted(f for f in known if f in flags)))
