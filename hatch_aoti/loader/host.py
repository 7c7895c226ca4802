"""Can this model run here: the CPU, the device, the Python and torch, the installed files.

The one owner of that question: ``load()`` asks it before loading, and ``hatch-aoti`` asks it
of a wheel's manifest without loading anything.
"""

from __future__ import annotations

import os
from typing import Any

from .packing import pack_ops
from .schema import PRECISION_VARIABLE, PRECISIONS, Cpu, Entry, precision_of, variants_of


def problems(entry: Entry, torch: Any = None) -> list[str]:
    """Why a model cannot run here, found without loading it: the CPU, the device, and for a
    precompiled model the Python and torch. ``load()`` refuses with the first; ``hatch-aoti`` asks
    this before loading. Without ``torch`` (not imported yet), the CPU is asked through /proc/cpuinfo.
    Which `cpu-target` to rebuild with is said of float32 alone: a lower precision's may be the build's."""
    caps = cpuid(torch) if torch is not None else None
    found = [cpu_problem(entry["cpu"], cpuid=caps, hint=precision_of(entry) == "float32")]
    if entry["device"].startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            found.append(f"was built for {entry['device']}, but this torch ({torch.__version__}) sees no CUDA device")
    if entry.get("backend") == "precompile":
        found.append(precompile_problem(entry, torch.__version__ if torch is not None else torch_version()))
    try:
        pack_ops()
    except ValueError as exc:
        found.append(f"cannot load here: {exc}")
    return [p for p in found if p]


#: What a precision needs of the CPU to run natively: any one of these features (CPUID's names, which
#: /proc/cpuinfo shares). Without one, bfloat16 arithmetic is emulated in float32, slower than float32,
#: and oneDNN multiplies int8 in pairs whose 16-bit sums saturate (docs/configuration.md#precision).
NATIVE = {"bfloat16": ("avx512_bf16", "amx_bf16"), "int8": ("avx512_vnni", "avx_vnni", "amx_int8")}
ENVIRONMENT = PRECISION_VARIABLE


def precision_problem(
    precision: str, cpuid: dict[str, bool] | None = None, flags: frozenset[str] | None = None
) -> str | None:
    """Why this CPU does not run ``precision`` natively, or ``None``; CPUID wins over /proc/cpuinfo, as in
    :func:`cpu_problem`."""
    needs = NATIVE.get(precision)
    if not needs:
        return None
    flags = host_flags() if flags is None else flags
    for feature in needs:
        answer = (cpuid or {}).get(feature)
        if answer is True or (answer is None and flags is not None and feature in flags):
            return None
    none = "neither" if len(needs) == 2 else "none of them"
    return f"needs a CPU with native {precision} arithmetic ({' or '.join(needs)}); this CPU has {none}"


def variant_problem(variant: Entry, torch: Any = None) -> str | None:
    """Why this CPU does not run a variant natively, its precision first, then what the CPU lacks of the
    variant's target (a lower-precision variant may be built for a wider one than its model's)."""
    return native_problem(variant, torch) or next(iter(problems(variant, torch)), None)


def native_problem(variant: Entry, torch: Any = None) -> str | None:
    """Why this CPU lacks the native arithmetic of a variant's precision, or of one it also computes in."""
    caps = cpuid(torch) if torch is not None else None
    found = precision_problem(precision_of(variant), caps)
    for also in variant.get("uses", []):
        problem = precision_problem(also, caps)
        found = found or (problem and f"computes in {also} too, and {problem}")
    return found


def choose(
    name: str, entry: Entry, wanted: str | None = None, torch: Any = None, *, refuse: bool = True
) -> tuple[Entry | None, dict[str, str]]:
    """The variant of a model that loads here, and why each one listed before it was passed over; where
    none runs here, an error, or ``None`` with every reason where ``refuse`` is false.

    ``wanted`` (``load(precision=...)`` or ``HATCH_AOTI_PRECISION``) picks one; a precision this CPU does
    not run natively is then an error rather than a slow model."""
    found = variants_of(entry)
    listed = ", ".join(precision_of(v) for v in found)
    if wanted is not None:
        if wanted not in PRECISIONS:
            raise ValueError(f"compiled model {name!r}: precision {wanted!r} is not one of {', '.join(PRECISIONS)}")
        match = next((v for v in found if precision_of(v) == wanted), None)
        if match is None:
            raise LookupError(f"compiled model {name!r} has no {wanted} variant; it was built in: {listed}")
        problem = variant_problem(match, torch)
        if problem is not None:
            raise RuntimeError(f"compiled model {name!r}: its {wanted} variant {problem}; its variants: {listed}")
        return match, {}
    passed: dict[str, str] = {}
    for variant in found:
        problem = variant_problem(variant, torch)
        if problem is None:
            return variant, passed
        passed[precision_of(variant)] = problem
    if len(found) == 1 and native_problem(entry, torch) is None:
        return entry, {}  # its own problem is told when it loads
    if not refuse:
        return None, passed
    reasons = "; ".join(f"{p}: {why}" for p, why in passed.items())
    raise RuntimeError(f"compiled model {name!r} has no variant that runs here ({reasons})")


def damaged(entry: Entry, directory: str) -> str | None:
    """A shipped file that is missing or of another size than the build wrote: loaded, a cut library
    ends the process (SIGBUS), a cut weights file fails with a bare torch error. Asked at load, not by
    :func:`problems`: ``hatch-aoti inspect`` reads a wheel without its files (``verify`` checks them)."""
    external = entry.get("weights", {}).get("external") is not None
    for rel, size in entry.get("sizes", {}).items():
        if external and rel == entry["weights"]["file"]:
            continue  # fetched into the cache, and verified there
        try:
            found: int | None = os.path.getsize(os.path.join(directory, rel))
        except OSError:
            found = None
        if found != size:
            state = "is missing" if found is None else f"has {found} bytes, not the {size} it was built with"
            return f"cannot load: its file {rel} {state}; the install is damaged (reinstall the package)"
    return None


def cpu_problem(
    cpu: Cpu,
    machine: str | None = None,
    flags: frozenset[str] | None = None,
    cpuid: dict[str, bool] | None = None,
    hint: bool = True,
) -> str | None:
    """The CPU's own answer (CPUID, as torch reads it) wins over /proc/cpuinfo, which an emulator or
    a container may copy from another machine; /proc/cpuinfo covers the features it lacks."""
    machine = machine or os.uname().machine
    if cpu["arch"] != machine:
        return f"was built for {cpu['arch']} CPUs ({cpu['target']}); this machine is {machine}"
    if flags is None:
        flags = host_flags()
    cpuid = cpuid or {}
    missing: list[str] = []
    for feature in cpu["features"]:
        answer = cpuid.get(CPUID_NAMES.get(feature, feature))
        if answer is False or (answer is None and flags is not None and feature not in flags):
            missing.append(feature)
    if not missing:
        return None
    lacks = f"needs a CPU with {cpu['target']} instructions; this CPU lacks {', '.join(missing)}"
    rebuild = '. Rebuild the wheel with an older `cpu-target` (for example "x86-64-v3") to run it here.'
    return lacks + rebuild if hint else lacks


def precompile_problem(entry: Entry, torch_version: str | None) -> str | None:
    """Precompiled code loads only under the Python and torch that made it."""
    import platform

    built, here = (entry["python"], entry["torch"]), (platform.python_version(), torch_version)
    if built == here:
        return None
    return (
        f"was precompiled with Python {built[0]} and torch {built[1]}, and loads only there; this is "
        f"Python {here[0]} with torch {here[1]}. Install a wheel built for them."
    )


def torch_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


#: /proc/cpuinfo flag names -> the names torch's CPUID reader (``torch.cpu.get_capabilities``) uses.
CPUID_NAMES = {
    "fma": "fma3",
    "bmi1": "bmi",
    "abm": "lzcnt",
    "pni": "sse3",
    "avx512f": "avx512_f",
    "avx512bw": "avx512_bw",
    "avx512cd": "avx512_cd",
    "avx512dq": "avx512_dq",
    "avx512vl": "avx512_vl",
    "avx512vbmi": "avx512_vbmi",
    "avx512ifma": "avx512_ifma",
}


def cpuid(torch: Any) -> dict[str, bool]:
    """What the CPU itself reports to this process (True/False by feature); empty where torch cannot say."""
    get = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    try:
        found = get() if get is not None else {}
    except Exception:
        return {}
    return {k: v for k, v in found.items() if isinstance(v, bool)}


_FLAGS: list[frozenset[str] | None] = []


def host_flags() -> frozenset[str] | None:
    """CPU flags of this machine from /proc/cpuinfo, read once; None where there is none."""
    if not _FLAGS:
        flags: frozenset[str] | None = None
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:
                    if line.startswith(("flags", "Features")):
                        flags = frozenset(line.split(":", 1)[1].split())
                        break
        except OSError:
            pass
        _FLAGS.append(flags)
    return _FLAGS[0]


def check_symbols(
    torch: Any,
    name: str,
    symbols: list[str],
    built_with: str,
    libraries: tuple[str, ...] = ("libtorch_cpu.so", "libtorch_cuda.so", "libtorch.so"),
) -> None:
    """Refuse, with the reason, a library that needs libtorch symbols this torch lacks (a C shim of a newer
    torch, say): loading it would fail with the dynamic loader's bare error, or worse."""
    import ctypes

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    handles = []
    for library in libraries:
        try:  # only those torch has loaded already: RTLD_NOLOAD loads nothing
            handles.append(ctypes.CDLL(os.path.join(lib, library), mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY))
        except OSError:
            continue
    missing = [s for s in symbols or () if handles and not any(hasattr(h, s) for h in handles)]
    if missing:
        raise RuntimeError(
            f"compiled model {name!r} was built with torch {built_with} and needs "
            f"{', '.join(missing)}, which this torch ({torch.__version__}) lacks; install the torch it "
            "was built with, or a wheel built for this one"
        )
