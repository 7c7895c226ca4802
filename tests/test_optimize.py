"""Packed weights, shipped dense and packed again at load; `optimize = "host"`; packing kept per process."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import TABLES, Runtime, build_no_isolation, write_project

from hatch_aoti.backends.interface import ProgramFacts
from hatch_aoti.pipeline import protocol
from hatch_aoti.settings.reader import ConfigError
from hatch_aoti.settings.resolve import parse_settings
from hatch_aoti.settings.spec import ModelSpec
from hatch_aoti.worker.coordinator import CANNOT_SHARE, Coordinator
from hatch_aoti.worker.helpers import Outcome
from hatch_aoti.worker.split import Miss, mixes_packing, processes

HATCH = TABLES["hatch"]
MODEL = {"factory": "m:f", "inputs": [{"shape": [1, 3, 8, 8]}]}


def specs(raw: dict) -> dict:
    return {s.name: s for s in parse_settings(raw, machine="x86_64", flags=set()).models}


def exported(spec: ModelSpec, program: Any) -> tuple[ModelSpec, ProgramFacts]:
    """The spec and the facts the coordinator has once the model is exported as ``program``."""
    from hatch_aoti.worker.facts import program_facts, resolved_weights

    facts = program_facts(program)
    return resolved_weights(spec, facts), facts


def problems(raw: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        parse_settings(raw, machine="x86_64", flags=set())
    return err.value.problems


def test_host_is_read_per_model_and_for_the_table_and_compiles_for_this_machine() -> None:
    found = specs({"optimize": "host", "models": {"a": MODEL, "b": {**MODEL, "optimize": "portable"}}})
    assert (found["a"].optimize, found["a"].cpu_target) == ("host", "native")
    assert (found["b"].optimize, found["b"].cpu_target) == ("portable", "x86-64-v3")
    assert specs({"models": {"a": MODEL}})["a"].optimize == "portable"


HOST_MODEL = {**MODEL, "optimize": "host"}


@pytest.mark.parametrize(
    ("raw", "where", "text"),
    [
        ({"models": {"a": {**MODEL, "optimize": "fast"}}}, "models.a.optimize", "must be one of portable, host"),
        ({"optimize": "hots", "models": {"a": MODEL}}, "optimize", "did you mean `host`"),
        ({"models": {"a": {**HOST_MODEL, "device": "cuda"}}}, "models.a.optimize", "is for CPU models, not cuda"),
        ({"optimize": "host", "models": {"a": {**MODEL, "device": "cuda"}}}, "models.a.device", '"portable"` on this'),
        ({"optimize": "host", "models": {"a": {**MODEL, "backend": "precompile"}}}, "models.a.backend", "'precompile'"),
        ({"models": {"a": {**HOST_MODEL, "cpu-target": "x86-64-v3"}}}, "models.a.cpu-target", "conflicts"),
        # a problem of the table's own keys is listed once, however many models it reaches
        ({"optimize": "host", "cpu-target": "x86-64-v3", "models": {"a": MODEL, "b": MODEL}}, "cpu-target", "native"),
        ({"optimize": "host", "backend": "precompile", "models": {"a": MODEL, "b": MODEL}}, "optimize", "`aoti`"),
    ],
)
def test_host_problems_name_the_key(raw: dict, where: str, text: str) -> None:
    ((path, message),) = problems(raw)
    assert path == f"{HATCH}.{where}" and text in message, (path, message)


def test_a_models_own_host_overrides_the_tables_target() -> None:
    found = specs({"cpu-target": "x86-64-v3", "models": {"a": HOST_MODEL, "b": MODEL}})
    assert (found["a"].cpu_target, found["b"].cpu_target) == ("native", "x86-64-v3")


def test_host_models_map_their_weights_as_any() -> None:
    found = specs({"optimize": "host", "models": {"a": {**MODEL, "weights": "mapped"}, "b": MODEL}})
    assert (found["a"].weights, found["b"].weights) == ("mapped", "auto")


def test_weights_are_packed_unless_they_cannot_ship_dense_or_their_products_are_small() -> None:
    import torch

    from hatch_aoti.backends.aoti import AotiBackend, packs_weights
    from hatch_aoti.settings.cpu_targets import resolve

    host, portable = specs({"models": {"h": {**MODEL, "optimize": "host"}, "p": MODEL}}).values()
    conv = torch.export.export(torch.nn.Conv2d(64, 64, 3), (torch.ones(1, 64, 56, 56),))  # packed at any size
    transposed = torch.export.export(torch.nn.ConvTranspose2d(64, 64, 3), (torch.ones(1, 64, 56, 56),))
    backend = AotiBackend()
    for spec, cpu in ((host, resolve("native")), (portable, resolve("x86-64-v3"))):
        (plain, plain_facts), (swapped, swapped_facts) = exported(spec, conv), exported(spec, transposed)
        assert plain_facts.repackable and not swapped_facts.repackable
        assert plain.weights == swapped.weights == "embedded", "small weights stay in the library, packed or not"
        assert packs_weights(backend.settings({}, cpu, plain, plain_facts))
        swapped_settings = backend.settings({}, cpu, swapped, swapped_facts)
        assert not packs_weights(swapped_settings), "transposed convolutions pack channels swapped"
        user = backend.settings({"cpp.weight_prepack": True}, cpu, swapped, swapped_facts)
        assert packs_weights(user), "the user's say wins"
    small, facts = exported(portable, torch.export.export(torch.nn.Linear(128, 256), (torch.ones(4, 128),)))
    assert facts.weighted_macs == 4 * 128 * 256 and facts.repackable
    assert not packs_weights(backend.settings({}, resolve("x86-64-v3"), small, facts)), "oneDNN's cost outweighs it"
    assert packs_weights(backend.settings({"cpp.weight_prepack": True}, resolve("x86-64-v3"), small, facts))
    big, facts = exported(portable, conv)
    facts = dataclasses.replace(facts, weights_bytes=2**30)
    assert not backend.settings({}, resolve("x86-64-v3"), big, facts)["freezing"]
    assert backend.settings({}, resolve("native"), dataclasses.replace(big, optimize="host"), facts)["freezing"]
    # packing needs freezing; Inductor packs by default whenever it freezes
    assert packs_weights({"freezing": True}) and not packs_weights({"cpp.weight_prepack": True})
    assert ModelSpec.from_json(json.loads(json.dumps(dataclasses.asdict(host)))) == host


def test_the_work_that_decides_prepacking_is_counted_per_op_by_a_weight() -> None:
    import torch

    from hatch_aoti.backends.aoti import fast_defaults
    from hatch_aoti.worker.facts import convolutions, weighted_macs

    export, nn = torch.export.export, torch.nn

    class MatMul(nn.Module):  # ``x @ W``
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(16, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    depthwise = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(288, 4))
    # the linear layer: 4 outputs of 288; the convolutions are not matrix products
    small_convolutions = export(depthwise, (torch.ones(1, 8, 8, 8),))
    assert weighted_macs(small_convolutions) == 4 * 288 and convolutions(small_convolutions) == 2
    spec, facts = exported(specs({"models": {"m": MODEL}})["m"], small_convolutions)
    assert fast_defaults(spec, facts)["cpp.weight_prepack"] is True, "convolutions run on oneDNN packed or not"
    head = [nn.Linear(16, 16) for _ in range(3)]  # small products, more than the convolutions
    mixed = export(nn.Sequential(nn.Conv2d(3, 16, 3), nn.Flatten(), *head), (torch.ones(1, 3, 3, 3),))
    spec, facts = exported(specs({"models": {"m": MODEL}})["m"], mixed)
    assert (facts.convolutions, facts.weighted_products) == (1, 3)
    assert fast_defaults(spec, facts)["cpp.weight_prepack"] is False, "packed small products lose more than it gains"
    even = export(nn.Sequential(nn.Conv2d(3, 16, 3), nn.Flatten(), nn.Linear(16, 16)), (torch.ones(1, 3, 3, 3),))
    spec, facts = exported(specs({"models": {"m": MODEL}})["m"], even)
    assert fast_defaults(spec, facts)["cpp.weight_prepack"] is False, "as many small products as convolutions"
    batch = ({0: torch.export.Dim("batch", min=1, max=64)},)
    assert weighted_macs(export(nn.Linear(128, 256), (torch.ones(4, 128),), dynamic_shapes=batch)) == 4 * 128 * 256
    assert weighted_macs(export(MatMul(), (torch.ones(2, 16),))) == 2 * 32 * 16
    assert convolutions(export(MatMul(), (torch.ones(2, 16),))) == 0
    same = nn.Conv2d(3, 4, 3, padding="same")  # exported as ``aten.conv2d.padding``
    assert convolutions(export(same, (torch.ones(1, 3, 8, 8),))) == 1
    unweighted, facts = exported(specs({"models": {"m": MODEL}})["m"], export(nn.ReLU(), (torch.ones(2),)))
    assert facts.weighted_macs is None and fast_defaults(unweighted, facts)["cpp.weight_prepack"] is True


def miss(label: str, packs: bool | None, in_helpers: bool = True) -> Miss:
    """A miss with only what routing reads: ``packs`` None for a model that does not freeze."""
    configs = {} if packs is None else {"freezing": True, "cpp.weight_prepack": packs}
    backend = SimpleNamespace(in_helpers=in_helpers)
    return Miss(None, None, "", {"inductor_configs": configs}, backend, label)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("models", "jobs", "expected"),
    [
        ("pp", 2, [["p0"], ["p1"]]),
        ("HH", 2, [["H0"], ["H1"]]),  # the coordinator takes a packing share when there is nothing else
        ("pH", 1, [["p0"], ["H1"]]),  # two kinds: two processes, even at one job
        ("ppH", 2, [["p0", "p1"], ["H2"]]),
        ("pppHHH", 4, [["p0", "p2"], ["p1"], ["H3", "H5"], ["H4"]]),
        ("pnH", 1, [["p0", "n1"], ["H2"]]),  # a model that does not freeze goes with either kind
        ("HnHn", 2, [["H0", "H2"], ["n1", "n3"]]),  # and with packing models alone, shares the jobs
    ],
)
def test_models_that_pack_and_models_that_do_not_never_share_a_process(
    models: str, jobs: int, expected: list[list[str]]
) -> None:
    kinds = {"p": False, "H": True, "n": None}
    misses = [miss(f"{kind}{i}", kinds[kind]) for i, kind in enumerate(models)]
    assert processes(misses, jobs) == expected
    by_label = {m.label: m for m in misses}
    for group in expected:
        assert not mixes_packing([by_label[label] for label in group])
    assert mixes_packing([miss("a", True), miss("b", False)]) and not mixes_packing([miss("a", True), miss("b", None)])


def test_a_packing_model_that_cannot_have_a_process_of_its_own_fails_clearly(tmp_path: Path) -> None:
    events: list[protocol.Event] = []
    self = object.__new__(Coordinator)
    self.emit, self.failed, self.stage = events.append, {}, tmp_path
    self.job = SimpleNamespace(jobs=1, sys_path=[], cwd=str(tmp_path), cache=None)
    self.task_for = lambda m: None  # type: ignore[method-assign]  # no program can be saved
    compiled = []
    self.compile_here = lambda m: compiled.append(m.label) or Outcome(m.label, error="not compiled here")  # type: ignore[method-assign]
    self.finish = lambda m, outcome: None  # type: ignore[method-assign]
    plain, packing = miss("plain", False), miss("packing", True)
    plain.model = packing.model = SimpleNamespace(spec=SimpleNamespace(name="x"))  # type: ignore[assignment]
    packing.model = SimpleNamespace(spec=SimpleNamespace(name="packing"))  # type: ignore[assignment]
    self.compile([plain, packing])
    assert compiled == ["plain"] and self.failed == {"packing": "compile"}
    (failed,) = [e for e in events if isinstance(e, protocol.Failed)]
    assert failed.message == CANNOT_SHARE


# -- a real build: packed weights shipped dense, mapped, and packed again where the model loads --------

MODELS = """
    import torch
    from torch import nn

    class Conv1D(nn.Module):  # transformers' (GPT-2): a linear layer with its weight kept as (in, out)
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(2800, 8) / 50), nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight)

    def net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 16, 3), nn.Flatten(), nn.Linear(16 * 14 * 14, 2800),  # 35 MB: mapped
            Conv1D(),
        ).eval()

    def small():  # its weights stay in the library
        torch.manual_seed(0)
        return net()[:4]

    def upsample():  # its zero pad folds into the convolution's padding
        torch.manual_seed(0)
        return nn.Sequential(nn.ZeroPad2d(1), nn.Conv2d(3, 8, 3), nn.ConvTranspose2d(8, 4, 3)).eval()
"""
HOOK = """
    # Packed as real-size models are by default: these ops are too small for the default to.
    [tool.hatch.build.targets.wheel.hooks.aoti.models.host]
    factory = "hostpkg.models:net"
    inputs = [{ shape = [2, 3, 16, 16] }]
    optimize = "host"
    inductor-configs = { "cpp.weight_prepack" = true }

    [tool.hatch.build.targets.wheel.hooks.aoti.models.portable]
    factory = "hostpkg.models:net"
    inputs = [{ shape = [2, 3, 16, 16] }]
    inductor-configs = { "cpp.weight_prepack" = true }

    [tool.hatch.build.targets.wheel.hooks.aoti.models.small]
    factory = "hostpkg.models:small"
    inputs = [{ shape = [2, 3, 16, 16] }]
    inductor-configs = { "cpp.weight_prepack" = true }

    [tool.hatch.build.targets.wheel.hooks.aoti.models.upsample]
    factory = "hostpkg.models:upsample"
    inputs = [{ shape = [2, 3, 16, 16] }]
"""
PACKED_CONV = b"aoti_torch_cpu_mkldnn__convolution_pointwise"
#: oneDNN's words for reordering a tensor of one of ``net``'s convolution weights' shapes.
WEIGHT_REORDER = re.compile(r",reorder,.*,(32x3x3x3|16x32x3x3),")
CALLS = """
    import ctypes, os, sys, threading
    os.environ["ONEDNN_VERBOSE"] = "1"  # read when oneDNN first runs
    sys.path.insert(0, {site!r})  # the wheel, its models module included
    import torch
    from hostpkg import compiled
    from hostpkg.models import net

    def mark(text):  # after what oneDNN printed so far, which C's stdio buffers
        ctypes.CDLL(None).fflush(None)
        os.write(1, text.encode() + b"\\n")

    x = torch.load({x!r})
    torch.save({{n: compiled.load(n)(x) for n in ("host", "portable", "small", "upsample")}}, {y!r})
    small, same = compiled.load("small"), []  # calls at once: containers made later get the packed weights too

    def call():
        same.extend(torch.equal(small(x), small(x)) for _ in range(20))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    mark(f"SAME {{len(same)}} {{all(same)}}")
    eager = net()
    with torch.no_grad():
        eager(x)  # oneDNN's own first-call work done
        mark("EAGER")
        eager(x)
        mark("COMPILED")
        compiled.load("portable")(x)
        compiled.load("small")(x)
        mark("END")
"""


@pytest.mark.integration
def test_packed_weights_ship_dense_and_are_packed_for_the_cpu_that_loads_them(
    tmp_path_factory: pytest.TempPathFactory, runtime: Runtime, tmp_path: Path
) -> None:
    import torch

    project = write_project(tmp_path_factory.mktemp("host") / "proj", "hostpkg", HOOK, {"models.py": MODELS})
    # One job: without a process of their own, the first model's packing would decide the others'.
    build_no_isolation(project, project / "dist", env={**os.environ, "HATCH_AOTI_JOBS": "1"})
    (wheel,) = (project / "dist").glob("*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        manifest = json.loads(zf.read("hostpkg/_aoti/manifest.json"))["models"]
    libraries = {name: next((site / "hostpkg" / "_aoti" / name).rglob("*.so")).read_bytes() for name in manifest}
    assert manifest["host"]["cpu"]["target"] == "native" and manifest["portable"]["cpu"]["target"] == "x86-64-v3"
    for name in ("host", "portable", "small"):
        assert PACKED_CONV in libraries[name] and ("weights" in manifest[name]) == (name != "small"), name
        assert manifest[name]["inductor_configs"]["cpp.weight_prepack"] is True
        ops = sorted(p["op"] for p in manifest[name]["packing"].values())
        linears = 0 if name == "small" else 2  # Linear and Conv1D
        assert ops == ["mkldnn::_reorder_convolution_weight"] * 2 + ["mkldnn::_reorder_linear_weight"] * linears, ops
    # Conv1D's weight, packed as its transpose, ships contiguous: the library would copy it per call.
    (conv1d,) = [t for t in manifest["portable"]["weights"]["tensors"].values() if t["shape"] == [8, 2800]]
    assert conv1d["stride"] == [2800, 1], conv1d
    upsampling = manifest["upsample"]
    assert upsampling["inductor_configs"]["cpp.weight_prepack"] is False and "packing" not in upsampling
    assert b"constant_pad_nd" not in libraries["upsample"], "no kernel copies the padded input"
    sys.path.insert(0, str(project))
    try:
        from hostpkg.models import net, small, upsample
    finally:
        sys.path.remove(str(project))
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    paths = {"site": str(site), "x": str(tmp_path / "x.pt"), "y": str(tmp_path / "y.pt")}
    shown = runtime.run(CALLS.format(**paths)).stdout
    with torch.no_grad():
        expected = {"host": net()(x), "portable": net()(x), "small": small()(x), "upsample": upsample()(x)}
    for name, y in torch.load(tmp_path / "y.pt").items():
        assert type(y) is torch.Tensor, name
        torch.testing.assert_close(y, expected[name], rtol=1e-4, atol=1e-5, msg=name)
    assert "SAME 40 True" in shown, shown[-2000:]
    eager_call, compiled_call = shown.split("EAGER\n", 1)[1].split("END\n", 1)[0].split("COMPILED\n")
    assert WEIGHT_REORDER.search(eager_call), "eager reorders its dense convolution weights on every call"
    assert not WEIGHT_REORDER.search(compiled_call), compiled_call
    # HATCH_AOTI_PACK=all packs the linear layers' weights too, for this CPU; the outputs stay eager's.
    packed = runtime.json(
        f"""
        import json, os, sys, warnings; os.environ["HATCH_AOTI_PACK"] = "all"; sys.path.insert(0, {str(site)!r})
        warnings.simplefilter("error")  # a packing that fails warns
        import torch
        from hostpkg import compiled
        model = compiled.load("portable")
        torch.save(model(torch.load({paths["x"]!r})), {str(tmp_path / "all.pt")!r})
        from hostpkg.compiled import packing
        chosen = packing.chosen(compiled.info("portable"))
        print(json.dumps(sorted(how["op"] for c, how in chosen.items() if model.weights[c].is_mkldnn)))
        """
    )
    assert packed == sorted(p["op"] for p in manifest["portable"]["packing"].values()), "each one packed"
    torch.testing.assert_close(torch.load(tmp_path / "all.pt"), expected["portable"], rtol=1e-4, atol=1e-5)
