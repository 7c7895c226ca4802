"""The manifest (``_aoti/manifest.json``): what the loader, ``hatch-aoti`` and the cache know of each
model. Its types are the loader's (:mod:`hatch_aoti.loader.schema`); here are its one writer and
its one check, used when it is written and when it is read."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path, PurePosixPath
from typing import Any

from hatch_aoti.loader.packing import BY_VALUE, OPS, VALUE_DTYPES
from hatch_aoti.loader.schema import ARTIFACT_DIR, FORMAT, MANIFEST, PRECISIONS, Manifest, precision_of

#: What every model entry has, and the type of each (manifest format 2).
ENTRY_KEYS = {"call": list, "cpu": dict, "device": str, "file": str}
CPU_KEYS = {"arch": str, "target": str, "features": list}
TOP_KEYS = {"package": str, "loader": str}
#: The largest file an entry may name (256 GiB): what a remote record may ask to download, and the
#: largest external weights file; a 70B-parameter model's bf16 weights take 140 GB.
MAX_FILE_SIZE = 2**38
#: The largest size, range bound or number of rows the loader's checks take (torch's own bound on sizes).
MAX_NUMBER = 2**62
OUTPUT_KINDS = ("tensor", "int", "float", "bool", "const")
PARAMETER_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_EXTERNAL = re.compile(r"[0-9a-f]{64}\.bin")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,3})?")
_DTYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")


def write(package_dir: Path, manifest: Manifest) -> Path:
    """``_aoti/manifest.json``, checked first. Models stay in declaration order (``names()``);
    everything else is sorted, so an entry reads the same whether compiled now or from the cache."""
    reason = problem(manifest)
    if reason is not None:
        raise ValueError(f"the manifest {reason}")
    models = {name: json.loads(json.dumps(entry, sort_keys=True)) for name, entry in manifest["models"].items()}
    path = package_dir / ARTIFACT_DIR / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**manifest, "models": models}, indent=2) + "\n", encoding="utf-8")
    path.chmod(0o644)
    return path


def read(package_dir: Path) -> Manifest:
    """The manifest of a package directory; a :class:`ValueError` says what makes it unusable."""
    try:
        data = json.loads((package_dir / ARTIFACT_DIR / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable {ARTIFACT_DIR}/{MANIFEST} ({exc})") from None
    reason = problem(data)
    if reason is not None:
        raise ValueError(f"{ARTIFACT_DIR}/{MANIFEST} {reason}")
    manifest: Manifest = data
    return manifest


def problem(manifest: Any) -> str | None:
    """What makes a manifest unusable, or ``None``: its readers can then index it freely."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("models"), dict):
        return "has no `models` table"
    if manifest.get("format") != FORMAT:
        return f"is of format {manifest.get('format')!r}; this hatch-aoti reads format {FORMAT}"
    for name, entry in manifest["models"].items():
        reason = entry_problem(entry)
        if reason is not None:
            return f"model {name!r}: {reason}"
    for key, kind in TOP_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            return f"`{key}` is missing or not a {kind.__name__}"
    return None


def entry_problem(entry: Any) -> str | None:
    """What makes one model's entry unusable, or ``None`` (the remote cache checks the entries it is sent).

    Every field that reaches the loader's generated code or a path is checked for its type and range:
    a damaged or hostile record (from a cache, say) is refused, never pasted into code nor joined
    into a path that leaves the package. Each of a model's variants is checked as an entry of its own."""
    reason = _one_entry_problem(entry)
    if reason is not None or "variants" not in entry:
        return reason
    variants = entry["variants"]
    if not isinstance(variants, list):
        return "`variants` is not a list"
    seen = [precision_of(entry)]
    for index, variant in enumerate(variants):
        reason = _one_entry_problem(variant)
        if reason is None and "variants" in variant:
            reason = "has variants of its own"
        if reason is None and precision_of(variant) in seen:
            reason = f"is a second {precision_of(variant)} variant"
        if reason is not None:
            return f"`variants[{index}]` {reason}"
        seen.append(precision_of(variant))
    return None


def _one_entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "not a table"
    if precision_of(entry) not in PRECISIONS:
        return f"`precision` is {entry.get('precision')!r}, not one of {', '.join(PRECISIONS)}"
    uses = entry.get("uses", [])
    if not isinstance(uses, list) or not all(isinstance(p, str) and p in PRECISIONS for p in uses):
        return f"`uses` is {uses!r}, not a list of precisions ({', '.join(PRECISIONS)})"
    for table, keys, label in ((entry, ENTRY_KEYS, ""), (entry.get("cpu"), CPU_KEYS, "cpu.")):
        for key, kind in keys.items():
            if not isinstance(table, dict) or not isinstance(table.get(key), kind):
                return f"`{label}{key}` is missing or not a {kind.__name__}"
    if not isinstance(entry.get("files", {}), dict):
        return "`files` is not a table"
    if not all(
        isinstance(leaf, dict) and ("const" in leaf or isinstance(leaf.get("shape"), list)) for leaf in entry["call"]
    ):
        return "`call` has an input without a shape"
    for check in (_device_problem, _files_problem, _call_problem, _outputs_problem, _other_problem):
        reason = check(entry)
        if reason is not None:
            return reason
    return None


def _integer(value: Any, low: int = 0, high: int = MAX_NUMBER) -> bool:
    """A plain int (not a bool, nor a string of code) within ``[low, high]``."""
    return type(value) is int and low <= value <= high


def _device_problem(entry: dict[str, Any]) -> str | None:
    if not _DEVICE.fullmatch(entry["device"]):
        return f"`device` is {entry['device']!r}, not cpu or cuda"
    return None


def inside(rel: Any) -> bool:
    """Whether ``rel`` is a plain relative path that stays in its directory: no absolute path, no ``..``,
    no backslash, nothing empty."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    path = PurePosixPath(rel)
    return path.as_posix() == rel and not path.is_absolute() and ".." not in path.parts


def _files_problem(entry: dict[str, Any]) -> str | None:
    """Every file the entry names lies inside its directory and, where it lists its files, is one of them."""
    files = entry.get("files")
    for rel, digest in (files or {}).items():
        if not inside(rel) or not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            return f"`files` names {rel!r}, which is not a file of the package with its sha256"
    sizes = entry.get("sizes", {})
    if not isinstance(sizes, dict) or not all(
        rel in (files or {}) and _integer(n, 0, MAX_FILE_SIZE) for rel, n in sizes.items()
    ):
        return "`sizes` gives a size to no file of the entry, or one out of range"
    weights = entry.get("weights")
    if weights is not None and not isinstance(weights, dict):
        return "`weights` is not a table"
    external = (weights or {}).get("external")
    named = [("file", entry["file"])]
    if weights is not None:
        named.append(("weights.file", weights.get("file")))
    regions = entry.get("regions", [])
    if not isinstance(regions, list) or not all(isinstance(r, dict) for r in regions):
        return "`regions` is not a list of tables"
    named += [(f"regions[{i}].file", r.get("file")) for i, r in enumerate(regions)]
    for label, rel in named:
        if not inside(rel):
            return f"`{label}` is {rel!r}, which is not a path inside the package"
        shipped = not (label == "weights.file" and external is not None)  # external weights leave the wheel
        if files is not None and shipped and rel not in files:
            return f"`{label}` is {rel!r}, which is not one of the entry's files"
    for i, region in enumerate(regions):
        dims = region.get("dims")
        if not isinstance(dims, dict) or not all(
            isinstance(v, list) and len(v) == 2 and _integer(v[0]) and (v[1] is None or _integer(v[1]))
            for v in dims.values()
        ):
            return f"`regions[{i}].dims` is not a range of sizes for each dim"
    return _members_problem(entry) or _weights_problem(weights)


def _members_problem(entry: dict[str, Any]) -> str | None:
    members, inline = entry.get("members", []), entry.get("inline", {})
    if not isinstance(members, list) or not all(inside(m) for m in members):
        return "`members` names a path that is not inside the package"
    if not isinstance(inline, dict) or not all(k in members and isinstance(v, str) for k, v in inline.items()):
        return "`inline` holds something other than text members"
    return None


def _weights_problem(weights: dict[str, Any] | None) -> str | None:
    if weights is None:
        return None
    if "sha256" in weights and not (isinstance(weights["sha256"], str) and _DIGEST.fullmatch(weights["sha256"])):
        return "`weights.sha256` is not a sha256"
    tensors = weights.get("tensors", {})
    if not isinstance(tensors, dict):
        return "`weights.tensors` is not a table"
    for name, place in tensors.items():
        if not (
            isinstance(place, dict)
            and isinstance(place.get("file"), str)
            and _NAME.fullmatch(place["file"])
            and _dtype(place.get("dtype"))
            and all(_integer(place.get(k), 0, MAX_FILE_SIZE) for k in ("storage_offset", "offset", "nbytes"))
            and all(isinstance(place.get(k), list) and all(_integer(n) for n in place[k]) for k in ("shape", "stride"))
        ):
            return f"`weights.tensors` places {name!r} where no weight can be"
    external = weights.get("external")
    if external is None:
        return None
    if not isinstance(external, dict) or not isinstance(external.get("url"), str):
        return "`weights.external` has no URL"
    if not isinstance(external.get("file"), str) or not _EXTERNAL.fullmatch(external["file"]):
        return f"`weights.external.file` is {external.get('file')!r}, not <sha256>.bin"
    if not _integer(external.get("size"), 1, MAX_FILE_SIZE):
        return f"`weights.external.size` is {external.get('size')!r}, not a size up to {MAX_FILE_SIZE} bytes"
    return None


def _dtype(name: Any) -> bool:
    return isinstance(name, str) and bool(_DTYPE.fullmatch(name))


def _call_problem(entry: dict[str, Any]) -> str | None:
    """Each input's dtype, device, sizes, dynamic ranges and rules, and index bound: plain values."""
    for position, leaf in enumerate(entry["call"]):
        where = f"call[{position}]"
        if "const" in leaf:
            if not isinstance(leaf.get("check_const", False), bool):
                return f"`{where}.check_const` is not a bool"
            continue
        if not _dtype(leaf.get("dtype")):
            return f"`{where}.dtype` is {leaf.get('dtype')!r}, not a dtype"
        if not isinstance(leaf.get("device"), str) or not _DEVICE.fullmatch(leaf["device"]):
            return f"`{where}.device` is {leaf.get('device')!r}, not cpu or cuda"
        if not isinstance(leaf.get("mutated", False), bool):
            return f"`{where}.mutated` is not a bool"
        if "index_rows" in leaf and not _integer(leaf["index_rows"]):
            return f"`{where}.index_rows` is {leaf['index_rows']!r}, not a number of rows"
        for bound in ("low", "high"):
            value = leaf.get(bound)
            if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
                return f"`{where}.{bound}` is {value!r}, not a number"
        for axis, dim in enumerate(leaf["shape"]):
            reason = _dim_problem(dim)
            if reason is not None:
                return f"`{where}.shape[{axis}]` {reason}"
    return None


def _dim_problem(dim: Any) -> str | None:
    if type(dim) is int:
        return None if _integer(dim) else f"is {dim!r}, out of range"
    if not isinstance(dim, dict):
        return f"is {dim!r}, neither a size nor a dim"
    if not isinstance(dim.get("name"), str) or not isinstance(dim.get("root", ""), str):
        return "has no name"
    low, high = dim.get("min"), dim.get("max")
    if type(low) is not int or not _integer(low) or not (high is None or _integer(high, low)):
        return f"has the range [{low!r}, {high!r}], not one of sizes"
    if not _integer(dim.get("mult", 1), 1) or not _integer(dim.get("offset", 0), -MAX_NUMBER):
        return f"has the rule {dim.get('mult')!r}*{dim.get('root')!r}{dim.get('offset')!r}, not a*dim + b"
    return None


def _outputs_problem(entry: dict[str, Any]) -> str | None:
    outputs = entry.get("outputs", [])
    tensors = len([leaf for leaf in entry["call"] if "const" not in leaf])
    if not isinstance(outputs, list):
        return "`outputs` is not a list"
    for index, out in enumerate(outputs):
        if not isinstance(out, dict) or out.get("kind") not in OUTPUT_KINDS:
            return f"`outputs[{index}]` is not of a kind the loader returns"
        if "view_of" in out and not _integer(out["view_of"], 0, tensors - 1):
            return f"`outputs[{index}].view_of` is {out['view_of']!r}, not one of the tensor inputs"
    return None


def _other_problem(entry: dict[str, Any]) -> str | None:
    """The signature, the packing ops and the serialised specs."""
    signature = entry.get("signature", [])
    if not isinstance(signature, list) or not all(
        isinstance(p, dict)
        and isinstance(p.get("name"), str)
        and p["name"].isidentifier()
        and p.get("kind") in PARAMETER_KINDS
        for p in signature
    ):
        return "`signature` has a parameter that is not one"
    packing = entry.get("packing", {})
    if not isinstance(packing, dict) or not all(
        isinstance(how, dict)
        and isinstance(how.get("op"), str)
        and how["op"] in OPS
        and isinstance(how.get("args"), list)
        and all(_plain(a) or _constant(a) for a in how["args"])
        for how in packing.values()
    ):
        return f"`packing` has a weight without a packing op ({', '.join(OPS)}) and plain arguments"
    specs = entry.get("call_spec", ["", ""])
    if not isinstance(specs, list) or len(specs) != 2 or not all(isinstance(s, str) for s in specs):
        return "`call_spec` is not two specs"
    return None


def _constant(value: Any) -> bool:
    """``{"constant": name}``, another of the model's weights, or ``{"values": [...], "dtype": name}``, a
    small tensor's values."""
    if not isinstance(value, dict):
        return False
    if list(value) == ["constant"]:
        return isinstance(value["constant"], str) and bool(_NAME.fullmatch(value["constant"]))
    values = value.get("values")
    return (
        sorted(value) == ["dtype", "values"]
        and value["dtype"] in VALUE_DTYPES
        and isinstance(values, list)
        and len(values) <= BY_VALUE
        and all(type(v) in (int, float) and math.isfinite(v) for v in values)
    )


def _plain(value: Any) -> bool:
    """A JSON value of numbers, strings, bools and None, in lists."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, float, str)
