"""Manifests and cache records that are damaged or hostile: each is refused with what is wrong, never
pasted into the loader's generated code nor joined into a path that leaves the package. No torch."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from hatch_aoti.pipeline.artifacts import file_hashes
from hatch_aoti.pipeline.manifest import entry_problem
from hatch_aoti.store.cache import CompileCache
from hatch_aoti.store.tiers import Tiers

CODE = "__import__('os').environ.__setitem__('MANIFEST_CODE_RAN', '1') or 0"
DIGEST = "ab" * 32


def good() -> dict[str, Any]:
    """An entry with every field the checks look at, as a build writes it."""
    dim = {"name": "n", "min": 1, "max": 64, "root": "n", "mult": 2, "offset": 1}
    return {
        "backend": "aoti",
        "call": [
            {"dtype": "float32", "device": "cpu", "shape": [dim, 3], "low": 0.0, "high": 1.0},
            {"dtype": "int64", "device": "cpu", "shape": [4], "index_rows": 10, "mutated": True},
            {"const": "mode", "check_const": True},
        ],
        "cpu": {"arch": "x86_64", "target": "native", "features": []},
        "device": "cpu",
        "file": "data/aotinductor/model/m.so",
        "files": {"data/aotinductor/model/m.so": DIGEST, "weights.bin": DIGEST},
        "sizes": {"data/aotinductor/model/m.so": 10, "weights.bin": 64},
        "members": ["data/aotinductor/model/m.so", "data/constants/x.json"],
        "inline": {"data/constants/x.json": "{}"},
        "outputs": [{"kind": "tensor", "view_of": 1}, {"kind": "int"}, {"kind": "const", "value": 3}],
        "signature": [{"name": "x", "kind": "POSITIONAL_OR_KEYWORD"}],
        "packing": {
            "w": {"op": "mkldnn::_reorder_convolution_weight", "args": [[1, 1], [0, 0], 1]},
            "q": {"op": "onednn::qconv_prepack", "args": [{"constant": "_scale_0"}, 0.5, 0, [1], [1], [1], 1, None]},
            "n": {"op": "onednn::qconv_prepack", "args": [{"values": [0.5], "dtype": "float32"}, 0.5, 0, [1], 1]},
        },
        "call_spec": ["[]", "[]"],
        "weights": {
            "file": "weights.bin",
            "sha256": DIGEST,
            "tensors": {
                "w": {
                    "file": "weight_0",
                    "dtype": "float32",
                    "shape": [4, 4],
                    "stride": [4, 1],
                    "storage_offset": 0,
                    "offset": 0,
                    "nbytes": 64,
                }
            },
        },
        "verification": {"passed": True, "tried": []},
    }


def changed(path: str, value: Any) -> dict[str, Any]:
    """``good()`` with the field at ``path`` (dotted; list indices as numbers) set to ``value``."""
    entry = good()
    *parents, last = path.split(".")
    table: Any = entry
    for key in parents:
        table = table[int(key)] if isinstance(table, list) else table.setdefault(key, {})
    table[int(last) if isinstance(table, list) else last] = value
    return entry


HOSTILE = {
    # wrong types
    "min a string of code": ("call.0.shape.0.min", CODE, "`call[0].shape[0]` has the range"),
    "max a float": ("call.0.shape.0.max", 64.5, "`call[0].shape[0]` has the range"),
    "mult a bool": ("call.0.shape.0.mult", True, "has the rule"),
    "offset code": ("call.0.shape.0.offset", CODE, "has the rule"),
    "static size code": ("call.0.shape.1", CODE, "`call[0].shape[1]` is"),
    "index_rows code": ("call.1.index_rows", CODE, "`call[1].index_rows` is"),
    "dtype not a name": ("call.0.dtype", "float32 or __import__('os')", "`call[0].dtype` is"),
    "leaf device": ("call.0.device", "cuda; import os", "`call[0].device` is"),
    "entry device": ("device", "tpu", "`device` is 'tpu'"),
    "output kind": ("outputs.1.kind", "eval", "`outputs[1]` is not of a kind"),
    "signature kind": ("signature.0.kind", "ANY", "`signature` has a parameter"),
    "signature name": ("signature.0.name", "x=1", "`signature` has a parameter"),
    "packing op": ("packing.w.op", "os.system", "`packing` has a weight"),
    "packing args": ("packing.w.args", [{"a": 1}], "`packing` has a weight"),
    "packing constant": ("packing.w.args", [{"constant": 1}], "`packing` has a weight"),
    "packing known op": ("packing.w.op", "aten::empty", "`packing` has a weight"),
    "packing op a list": ("packing.w.op", ["mkldnn::_reorder_convolution_weight"], "`packing` has a weight"),
    "packing values dtype": ("packing.w.args", [{"values": [1.0], "dtype": "qint8"}], "`packing` has a weight"),
    "packing values": ("packing.w.args", [{"values": ["1e9"], "dtype": "float32"}], "`packing` has a weight"),
    "packing many values": ("packing.w.args", [{"values": [1.0] * 65, "dtype": "float32"}], "`packing` has a"),
    "place offset": ("weights.tensors.w.offset", "0", "`weights.tensors` places 'w'"),
    "external size code": (
        "weights.external",
        {"url": "https://x/{file}", "file": DIGEST + ".bin", "size": "1"},
        "size",
    ),
    "region dims": ("regions", [{"file": "weights.bin", "sha256": DIGEST, "dims": {"n": ["1", 2]}}], "dims"),
    # out of range
    "negative min": ("call.0.shape.0.min", -1, "has the range"),
    "max below min": ("call.0.shape.0.max", 0, "has the range"),
    "huge size": ("call.0.shape.1", 2**70, "out of range"),
    "mult zero": ("call.0.shape.0.mult", 0, "has the rule"),
    "view of no input": ("outputs.0.view_of", 2, "`outputs[0].view_of` is 2"),
    "file size": ("sizes.weights.bin", 2**50, "`sizes`"),
    "external size": ("weights.external", {"url": "https://x/{file}", "file": DIGEST + ".bin", "size": 2**50}, "size"),
    # paths that leave the package
    "file absolute": ("file", "/etc/passwd", "`file` is '/etc/passwd', which is not a path inside the package"),
    "file up": ("file", "../../x.so", "`file` is '../../x.so', which is not a path inside the package"),
    "file backslash": ("file", "..\\x.so", "not a path inside the package"),
    "file not its own": ("file", "other.so", "`file` is 'other.so', which is not one of the entry's files"),
    "weights up": ("weights.file", "../../../../.pypirc", "`weights.file` is '../../../../.pypirc'"),
    "files key up": ("files", {"../x": DIGEST}, "`files` names '../x'"),
    "member up": ("members", ["../../x"], "`members` names a path"),
    "region up": ("regions", [{"file": "../m.bin", "sha256": DIGEST, "dims": {}}], "`regions[0].file` is '../m.bin'"),
    "external not a digest": (
        "weights.external",
        {"url": "https://x/{file}", "file": "../x", "size": 10},
        "`weights.external.file` is '../x', not <sha256>.bin",
    ),
    "place file a path": ("weights.tensors.w.file", "../../w", "`weights.tensors` places 'w'"),
}


def test_a_good_entry_passes() -> None:
    assert entry_problem(good()) is None
    external = changed("weights.external", {"url": "https://x/{file}", "file": DIGEST + ".bin", "size": 64})
    del external["files"]["weights.bin"], external["sizes"]["weights.bin"]  # the weights left the wheel
    assert entry_problem(external) is None


@pytest.mark.parametrize(("path", "value", "message"), HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_entry_is_refused_with_what_is_wrong(path: str, value: Any, message: str) -> None:
    problem = entry_problem(changed(path, value))
    assert problem is not None and message in problem, problem


class FakeEngine:
    """What the generated fast path reads of a model, with a dim range from a hostile manifest."""

    constants: list[Any] = []
    leaves = [{"dtype": "float32"}]
    tensor_index = [0]
    index_rows: list[Any] = []
    unsafe = None
    aminmax = None

    def __init__(self, low: Any = 1, rows: Any = None) -> None:
        self.checks = [("D", True, (None,), ((0, low, 8, "n", 1, 0),))]
        self.index_rows = [] if rows is None else [(0, rows)]


@pytest.mark.parametrize("field", ["min", "index_rows"])
def test_code_in_a_number_never_runs(field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader (which does not run the build's checks) takes numbers into its generated code only through
    ``int()``: a string of code fails to load, and runs neither then nor at a call."""
    from hatch_aoti.loader.fastpath import _inline_checks

    monkeypatch.delenv("MANIFEST_CODE_RAN", raising=False)
    engine = FakeEngine(low=CODE) if field == "min" else FakeEngine(rows=CODE)
    lines: list[str] = []
    with pytest.raises(ValueError, match="invalid literal for int"):
        _inline_checks(engine, ["v0"], lines, {})  # type: ignore[arg-type]
    assert not any("__import__" in line for line in lines)
    assert "MANIFEST_CODE_RAN" not in os.environ


# -- a cache record with such an entry is a miss ----------------------------------------------


def stored(root: Path, artifact: Path, entry: dict[str, Any]) -> CompileCache:
    cache = CompileCache(root)
    cache.store(DIGEST, artifact, {"entry": entry, "errors": None})
    return cache


@pytest.mark.parametrize(
    "hostile", ["call.0.shape.0.min", "weights.file"], ids=["code in a number", "weights outside the package"]
)
def test_a_local_record_with_a_hostile_entry_is_rebuilt(tmp_path: Path, hostile: str) -> None:
    artifact = tmp_path / "art"
    artifact.mkdir()
    (artifact / "m.so").write_bytes(b"\x7fELF")
    (artifact / "weights.bin").write_bytes(b"w" * 64)
    entry = copy.deepcopy(good())
    entry["file"] = "m.so"
    entry["files"] = file_hashes(artifact, {})
    entry["sizes"] = {rel: (artifact / rel).stat().st_size for rel in entry["files"]}
    entry["members"], entry["inline"] = [], {}
    bad = json.loads(json.dumps(entry))
    bad["call"][0]["shape"][0]["min"] = CODE
    if hostile == "weights.file":
        bad = {**entry, "weights": {**entry["weights"], "file": "../../../../.pypirc"}}
    cache = stored(tmp_path / "cache", artifact, bad)
    notices: list[str] = []
    tiers = Tiers(cache, None, notices.append, tmp_path / "scratch")
    assert tiers.lookup("m", DIGEST, "aoti", tmp_path / "out") is None
    assert len(notices) == 1 and "the compile cache's entry is damaged: its record has an unusable" in notices[0]
    assert not (tmp_path / "out").exists() and cache.entries() == [], "the entry is gone: the model is rebuilt"
    stored(tmp_path / "cache", artifact, entry)  # the rebuilt model takes its place
    found = Tiers(CompileCache(tmp_path / "cache"), None, notices.append, tmp_path / "scratch").lookup(
        "m", DIGEST, "aoti", tmp_path / "out"
    )
    assert found is not None and found[1] == "local" and len(notices) == 1


def test_index_rows_takes_placeholders_that_are_not_tensors() -> None:
    """torch's export example ``tensor_setattr`` has a str input: its placeholder's value is the str."""
    from types import SimpleNamespace

    from hatch_aoti.worker.entry import index_rows

    node = SimpleNamespace(op="placeholder", name="attr", meta={"val": "weight"}, users={})
    none = SimpleNamespace(op="placeholder", name="flag", meta={"val": None}, users={})
    assert index_rows(SimpleNamespace(graph=SimpleNamespace(nodes=[node, none]))) == {}
