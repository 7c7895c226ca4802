"""Precision variants: the settings, the loader's choice per CPU, the bfloat16 and int8 exports, and the
lower-precision check (the wheel built with variants: test_precision_wheel.py)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hatch_aoti.loader import host
from hatch_aoti.pipeline.manifest import entry_problem
from hatch_aoti.settings.reader import ConfigError
from hatch_aoti.settings.resolve import parse_settings
from hatch_aoti.worker.precision import bfloat16_layers, verify_variant
from hatch_aoti.worker.verify import VerificationFailed

TABLE = "tool.hatch.build.targets.wheel.hooks.aoti"

# -- settings ------------------------------------------------------------------------------------------------


def model(**keys: Any) -> dict[str, Any]:
    return {"factory": "m:f", "inputs": [{"shape": [2, 8]}], **keys}


def test_precision_is_one_value_or_a_list_in_order_and_the_table_gives_the_default() -> None:
    settings = parse_settings(
        {"precision": ["bfloat16", "float32"], "models": {"a": model(), "b": model(precision="int8")}}
    )
    a, b = settings.models
    assert a.precision == ("bfloat16", "float32") and a.variants == [("a@bfloat16", "bfloat16"), ("a", "float32")]
    assert b.precision == ("int8",)
    assert parse_settings({"models": {"c": model()}}).models[0].precision == ("float32",)


def test_every_precision_problem_is_listed_at_once_with_its_path() -> None:
    raw = {
        "precision": ["bf16"],
        "models": {
            "twice": model(precision=["int8", "int8"]),
            "other": model(precision="bfloat16", backend="precompile", calibration="m:c"),
            "far": model(precision="bfloat16", accuracy={"int8": {"rel-error": 0.5}, "bfloat16": {"cosine": 2}}),
            "gpu": model(precision=["bfloat16", "float32"], device="cuda"),
        },
    }
    with pytest.raises(ConfigError) as raised:
        parse_settings(raw)
    found = dict(raised.value.problems)
    assert found[f"{TABLE}.precision[0]"] == "unknown precision 'bf16' (did you mean `bfloat16`?)"
    assert found[f"{TABLE}.models.twice.precision[1]"] == "'int8' is listed twice"
    assert "for `aoti` models" in found[f"{TABLE}.models.other.precision"]
    assert found[f"{TABLE}.models.other.calibration"] == "applies only where `precision` lists `int8`"
    assert found[f"{TABLE}.models.far.accuracy.bfloat16.cosine"] == "must be between 0 and 1, not 2"
    assert "for CPU models" in found[f"{TABLE}.models.gpu.precision"]


def test_an_accuracy_table_for_a_precision_the_model_does_not_build_is_refused() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_settings({"models": {"a": model(precision="bfloat16", accuracy={"int8": {"rel-error": 0.5}})}})
    assert dict(raised.value.problems)[f"{TABLE}.models.a.accuracy.int8"].startswith("applies to a lower precision")


# -- the loader's choice ------------------------------------------------------------------------------------

HERE = {"arch": os.uname().machine, "target": "x86-64-v3", "features": []}


def entry(*precisions: str) -> dict[str, Any]:
    first, *rest = ({"cpu": HERE, "device": "cpu", "precision": p} for p in precisions)
    return {**first, "variants": rest} if rest else first


NO_BF16 = {"avx512_bf16": False, "amx_bf16": False, "avx2": True, "avx512_vnni": True}
BF16 = {"avx512_bf16": True, "amx_bf16": False}
NO_VNNI = {"avx512_bf16": False, "amx_bf16": False, "avx512_vnni": False, "avx_vnni": False, "amx_int8": False}


def choose(found: dict[str, Any], wanted: str | None, caps: dict[str, bool]) -> tuple[Any, dict[str, str]]:
    class FakeTorch:
        __version__ = torch.__version__

        class cpu:
            @staticmethod
            def get_capabilities() -> dict[str, bool]:
                return caps

    return host.choose("m", found, wanted, FakeTorch)  # type: ignore[arg-type]


def test_the_first_variant_this_cpu_runs_natively_is_chosen_and_the_others_say_why_not() -> None:
    found = entry("bfloat16", "int8", "float32")
    chosen, passed = choose(found, None, NO_BF16)
    assert chosen["precision"] == "int8"
    assert passed == {
        "bfloat16": "needs a CPU with native bfloat16 arithmetic (avx512_bf16 or amx_bf16); this CPU has neither"
    }
    chosen, passed = choose(found, None, BF16)
    assert chosen["precision"] == "bfloat16" and passed == {}
    chosen, _ = choose(found, None, {"avx512_bf16": False, "amx_bf16": True})
    assert chosen["precision"] == "bfloat16", "AMX-BF16 alone is native bfloat16"
    chosen, passed = choose(found, None, NO_VNNI)
    assert chosen["precision"] == "float32", "int8 without VNNI saturates"
    assert passed["int8"] == (
        "needs a CPU with native int8 arithmetic (avx512_vnni or avx_vnni or amx_int8); this CPU has none of them"
    )
    assert choose(found, None, {**NO_VNNI, "avx_vnni": True})[0]["precision"] == "int8"


def test_a_variant_built_for_a_wider_target_is_passed_over_where_the_cpu_lacks_it() -> None:
    wide = {"arch": os.uname().machine, "target": "x86-64-v4", "features": ["avx512f", "definitely_not_a_flag"]}
    found = {**entry("int8", "float32"), "cpu": wide}
    chosen, passed = choose(found, None, {"avx512_vnni": True})
    assert chosen["precision"] == "float32"
    assert "definitely_not_a_flag" in passed["int8"], passed


def test_the_cli_asks_of_the_variant_that_loads_not_the_first_listed() -> None:
    from types import SimpleNamespace

    from hatch_aoti.cli import machine

    wide = {"arch": os.uname().machine, "target": "x86-64-v4", "features": ["definitely_not_a_flag"]}
    found = {**entry("int8", "float32"), "cpu": wide}

    class Target:
        dist = SimpleNamespace(requires=[])

        def model(self, name: str) -> dict[str, Any]:
            return found

    assert machine.problems(Target(), "m") == [], "float32 loads here"  # type: ignore[arg-type]
    assert machine.variant_of(Target(), "m")["precision"] == "float32"  # type: ignore[arg-type]
    (problem,) = machine.problems(Target(), "m", "int8")  # type: ignore[arg-type]
    assert "lacks definitely_not_a_flag" in problem and "Rebuild" not in problem, "the build chose that target"
    listed = machine.variants(Target(), "m")["variants"]  # type: ignore[arg-type]
    assert [(v["precision"], v["cpu_target"], v["native_here"]) for v in listed] == [
        ("int8", "x86-64-v4", False),
        ("float32", "x86-64-v3", True),
    ]
    with pytest.raises(RuntimeError, match="its int8 variant needs a CPU with x86-64-v4 instructions"):
        choose(found, "int8", {"avx512_vnni": True})


def test_the_cpus_own_answer_wins_over_proc_cpuinfo() -> None:
    assert host.precision_problem("bfloat16", {"avx512_bf16": False}, frozenset({"avx512_bf16"})) is not None
    assert host.precision_problem("bfloat16", {}, frozenset({"avx512_bf16"})) is None, "/proc/cpuinfo fills the gaps"
    assert host.precision_problem("int8", NO_BF16, frozenset()) is None
    assert host.precision_problem("int8", {}, frozenset({"avx_vnni"})) is None
    assert host.precision_problem("int8", NO_VNNI, frozenset({"avx512_vnni"})) is not None
    assert host.precision_problem("float32", NO_VNNI, frozenset()) is None


def test_a_variant_asked_for_is_taken_or_refused_with_the_reason() -> None:
    found = entry("bfloat16", "float32")
    assert choose(found, "float32", BF16)[0]["precision"] == "float32"
    with pytest.raises(RuntimeError, match="its bfloat16 variant needs a CPU with native bfloat16"):
        choose(found, "bfloat16", NO_BF16)
    with pytest.raises(LookupError, match="has no int8 variant; it was built in: bfloat16, float32"):
        choose(found, "int8", BF16)
    with pytest.raises(ValueError, match="precision 'fp16' is not one of float32, bfloat16, int8"):
        choose(found, "fp16", BF16)


def test_a_model_whose_only_variant_cannot_run_natively_is_refused() -> None:
    with pytest.raises(RuntimeError, match="has no variant that runs here"):
        choose(entry("bfloat16"), None, NO_BF16)
    assert choose(entry("float32"), None, NO_BF16)[0]["precision"] == "float32"


def test_the_manifest_refuses_a_variant_that_is_not_one() -> None:
    plain = {"call": [], "cpu": HERE, "device": "cpu", "file": "m.so"}
    assert entry_problem({**plain, "precision": "bfloat16", "variants": [plain]}) is None
    assert entry_problem({**plain, "precision": "fp8"}) == "`precision` is 'fp8', not one of float32, bfloat16, int8"
    assert entry_problem({**plain, "variants": [plain]}) == "`variants[0]` is a second float32 variant"
    nested = {**plain, "precision": "int8", "variants": []}
    assert entry_problem({**plain, "variants": [nested]}) == "`variants[0]` has variants of its own"
    assert entry_problem({**plain, "variants": [{**plain, "precision": "int8", "file": "../x"}]}) is not None


def test_an_int8_variant_freezes_and_packs_at_any_size_so_its_weights_can_ship_outside_the_library() -> None:
    """oneDNN's int8 kernels come only with freezing, and the recorded packing is what lets the wheel ship
    the int8 weights dense (mapped or external) for the loader to pack."""
    from hatch_aoti.backends.aoti import fast_defaults, packs_weights
    from hatch_aoti.backends.interface import ProgramFacts
    from hatch_aoti.worker.facts import resolved_weights

    (spec,) = parse_settings(
        {"models": {"a": model(precision="int8", weights="external", **{"weights-url": "https://x/{file}"})}}
    ).models
    for facts in (
        ProgramFacts(weights_bytes=2**31, weighted_macs=10**9, weighted_products=4),  # an LLM's
        ProgramFacts(weights_bytes=2**20, weighted_macs=1000, weighted_products=4),  # small products
    ):
        assert resolved_weights(spec, facts).weights == "external"
        assert packs_weights(fast_defaults(spec, facts)), facts
        assert not packs_weights(fast_defaults(dataclasses.replace(spec, precision=("float32",)), facts)), facts


def test_the_int8_variant_of_a_portable_model_is_built_for_avx512_where_the_build_can_verify_it() -> None:
    from hatch_aoti.settings.cpu_targets import TARGETS
    from hatch_aoti.worker.checks import Prepared
    from hatch_aoti.worker.precision import variants

    (spec,) = parse_settings({"cpu-target": "x86-64-v3", "models": {"a": model(precision=["int8", "float32"])}}).models
    prepared = Prepared(spec, torch.nn.Linear(8, 2), None)
    found, notes = variants(prepared, set(TARGETS["x86-64-v4"].features), {})
    assert [(v.spec.name, v.spec.cpu_target) for v in found] == [("a@int8", "x86-64-v4"), ("a", "x86-64-v3")]
    assert notes == [
        "a@int8: built for x86-64-v4 rather than x86-64-v3: CPUs without AVX-512 (AVX-VNNI alone "
        "included) load the next variant listed"
    ]
    found, notes = variants(prepared, set(TARGETS["x86-64-v3"].features), {})
    assert [v.spec.cpu_target for v in found] == ["x86-64-v3", "x86-64-v3"]
    assert notes[0].startswith("a@int8: built for x86-64-v3, not x86-64-v4, since this machine needs a CPU")
    assert "lacks avx512" in notes[0] and "Rebuild" not in notes[0]
    found, _ = variants(prepared, set(TARGETS["x86-64-v4"].features), {"avx512_f": False})
    assert found[0].spec.cpu_target == "x86-64-v3", "the CPU's own answer wins over /proc/cpuinfo"
    (other,) = parse_settings({"cpu-target": "x86-64-v3", "models": {"a": model(precision="bfloat16")}}).models
    found, _ = variants(Prepared(other, torch.nn.Linear(8, 2), None), set(TARGETS["x86-64-v4"].features), {})
    assert found[0].spec.cpu_target == "x86-64-v3", "bfloat16 gains nothing from AVX-512's integer kernels"
    (native,) = parse_settings({"cpu-target": "native", "models": {"a": model(precision="int8")}}).models
    found, _ = variants(Prepared(native, torch.nn.Linear(8, 2), None), set(), {})
    assert found[0].spec.cpu_target == "native"


# -- the bfloat16 export and the check ----------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.conv(x).mean((2, 3))
        return self.fc(self.norm(h)), h.argmax(-1)


def test_a_build_machine_without_vnni_verifies_int8_in_7_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its saturating products would be what verification judges, which no CPU that loads int8 computes."""
    pytest.importorskip("torchao")
    from hatch_aoti.worker import precision
    from hatch_aoti.worker.checks import Prepared

    (spec,) = parse_settings({"models": {"q": model(precision="int8")}}).models
    linear, x = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval(), torch.randn(2, 8)

    def ranges(vnni: bool) -> tuple[set[Any], str | None]:
        monkeypatch.setattr(precision, "has_vnni", lambda: vnni)
        program, note, _ = precision.export(Prepared(spec, linear, None), (x,), {}, None)
        return {n.args[1:3] for n in program.graph.nodes if "choose_qparams" in str(n.target)}, note

    assert ranges(True) == ({(0, 255)}, "int8: 1 of 1 linear layer (1 smoothed), 0 of 0 convolutions")
    found, note = ranges(False)
    assert found == {(0, 127)} and note is not None and note.endswith(precision.NARROWED)


def test_without_calibration_an_int8_variants_convolutions_take_the_next_variants_precision() -> None:
    """``["int8", "bfloat16"]``: its convolutions in bfloat16, which the loader then also asks the CPU for;
    ``["int8", "float32"]``, or with samples to calibrate them on: nothing in bfloat16."""
    pytest.importorskip("torchao")
    from hatch_aoti.worker.checks import Prepared
    from hatch_aoti.worker.precision import export, variants

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4)
    ).eval()
    x = torch.randn(2, 3, 8, 8)
    calibration = [((torch.randn(2, 3, 8, 8),), {})]

    def exported(listed: list[str], samples: Any = None) -> tuple[set[Any], str | None, list[str]]:
        (spec,) = parse_settings({"models": {"n": model(precision=listed)}}).models
        found, _ = variants(Prepared(spec, net, None), flags=set(), caps={})
        (int8,) = [v for v in found if v.spec.precision[0] == "int8"]
        program, note, uses = export(dataclasses.replace(int8, calibration=samples), (x,), {}, None)
        convs = [n for n in program.graph.nodes if "conv" in str(n.target)]
        weights = {"int8" if "dequantize" in str(n.args[1].target) else n.args[1].meta["val"].dtype for n in convs}
        return weights, note, uses

    dtypes, note, uses = exported(["int8", "bfloat16", "float32"])
    assert dtypes == {torch.bfloat16} and uses == ["bfloat16"], (dtypes, uses)
    assert note is not None and "0 of 1 convolution (no `calibration`: the others compute in bfloat16" in note
    assert exported(["bfloat16", "int8", "float32"])[::2] == ({torch.float32}, []), "float32 comes after int8"
    assert exported(["int8", "bfloat16"], calibration)[::2] == ({"int8"}, []), "calibrated: int8"
    unchanged = all(m.weight.dtype == torch.float32 and "forward" not in m.__dict__ for m in (net[0], net[3]))
    assert unchanged, "the module as it was"


def test_a_variant_that_also_computes_in_bfloat16_needs_native_bfloat16_too() -> None:
    entry = {"precision": "int8", "uses": ["bfloat16"], "cpu": {"arch": "x86_64", "target": "t", "features": []}}
    vnni = {"avx512_vnni": True, "avx512_bf16": False, "amx_bf16": False}
    problem = host.native_problem(entry, SimpleNamespace(cpu=SimpleNamespace(get_capabilities=lambda: vnni)))
    assert problem is not None and problem.startswith("computes in bfloat16 too, and needs a CPU with native bfloat16")
    both = {**vnni, "avx512_bf16": True}
    assert host.native_problem(entry, SimpleNamespace(cpu=SimpleNamespace(get_capabilities=lambda: both))) is None
    assert entry_problem({**entry, "call": [], "device": "cpu", "file": "f", "uses": ["fp8"]}) is not None


class Normed(torch.nn.Module):
    """A convolution whose bias the batch norm after it takes away again, as a channel's mean is."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.shared = torch.nn.Conv2d(8, 8, 1)  # called twice: left as it is
        self.tail = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 1), torch.nn.BatchNorm2d(8))
        self.side = torch.nn.Conv2d(8, 8, 1)  # read by its norm and by the sum: left as it is
        self.side_norm = torch.nn.BatchNorm2d(8)
        with torch.no_grad():
            self.conv.bias.fill_(1000.0)
            self.norm.running_mean.fill_(1000.0)
            for norm in (self.norm, self.tail[1], self.side_norm):
                norm.weight.uniform_(0.5, 2.0)
                norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x)))
        h = self.shared(self.shared(h))
        s = self.side(h)
        return self.tail(h) + self.side_norm(s) + s


def test_batch_norms_are_folded_into_the_convolutions_before_them_in_a_copy() -> None:
    from hatch_aoti.worker.batchnorm import folded_batch_norms

    torch.manual_seed(0)
    model, x = Normed().eval(), torch.randn(2, 3, 16, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(x)
    folded, count = folded_batch_norms(model, (x,), {}, None)
    assert count == 2, "conv+norm and tail; not the shared convolution, nor one whose output is read twice"
    assert isinstance(folded.norm, torch.nn.Identity) and isinstance(folded.tail[1], torch.nn.Identity)
    assert folded.shared is model.shared and folded.side_norm is model.side_norm
    assert isinstance(model.norm, torch.nn.BatchNorm2d) and isinstance(model.tail[1], torch.nn.BatchNorm2d)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the model is left as it was"
    with torch.no_grad():
        torch.testing.assert_close(folded(x), expected, rtol=1e-4, atol=1e-3)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    assert folded_batch_norms(plain, (torch.randn(1, 4),), {}, None) == (plain, 0)


def test_a_bfloat16_convolution_rounds_after_its_batch_norm_takes_the_mean_away() -> None:
    from hatch_aoti.worker.batchnorm import folded_batch_norms

    torch.manual_seed(0)
    normed, x = Normed().eval(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = normed(x)

    def error(module: torch.nn.Module) -> float:
        with bfloat16_layers(module):
            program = torch.export.export(module, (x,))
        with torch.no_grad():
            y = program.module()(x)
        return float((y - expected).norm() / expected.norm())

    assert error(folded_batch_norms(normed, (x,), {}, None)[0]) < 0.02
    assert error(normed) > 0.1, "rounded at 1000, before the norm subtracts it"

    from hatch_aoti.worker.checks import Prepared
    from hatch_aoti.worker.precision import export

    (spec,) = parse_settings({"models": {"n": model(precision="bfloat16")}}).models
    program, *_ = export(Prepared(spec, normed, None), (x,), {}, None)
    norms = [node for node in program.graph.nodes if "batch_norm" in str(node.target)]
    assert len(norms) == 1, "the side convolution's alone, whose output the sum reads too"
    with torch.no_grad():
        y = program.module()(x)
    assert float((y - expected).norm() / expected.norm()) < 0.02, "the build's bfloat16 export folds them"


def test_the_bfloat16_export_leaves_the_module_as_it_was_and_takes_and_returns_float32() -> None:
    torch.manual_seed(0)
    block = Block().eval()
    before = {k: (v, v.clone()) for k, v in block.state_dict(keep_vars=True).items()}
    x = torch.randn(2, 3, 8, 8)
    with bfloat16_layers(block) as count:
        program = torch.export.export(block, (x,))
    assert count == 2
    assert all(block.state_dict(keep_vars=True)[k] is v and torch.equal(v, copy) for k, (v, copy) in before.items())
    assert "forward" not in block.conv.__dict__, "the layer's own forward is back"
    weights = program.state_dict
    assert weights["conv.weight"].dtype == weights["fc.weight"].dtype == torch.bfloat16
    assert weights["norm.weight"].dtype == torch.float32, "norms stay in float32"
    y, index = program.module()(x)
    expected, _ = block(x)
    assert y.dtype == torch.float32 and index.dtype == torch.int64
    assert float((y - expected).norm() / expected.norm()) < 0.02


LIMIT = {"rel_error": 0.02, "cosine": 0.999}


def test_a_variant_close_to_eager_passes_and_a_further_one_fails_naming_its_precision() -> None:
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(2, 3, 8, 8)
    samples = [("example", ((x,), {}))]
    report, worst = verify_variant(block, samples, lambda t: block(t), "bfloat16", LIMIT)
    assert report["passed"] and report["precision"] == "bfloat16" and report["rel_error"] == 0.02
    assert worst["rel_error"] < 1e-6 and worst["cosine"] > 0.999999
    assert report["against"] == ["float64 reference"]

    def noisy(t: torch.Tensor) -> Any:
        y, i = block(t)
        return y + 0.1 * y.abs().mean() * torch.randn_like(y), i

    with pytest.raises(VerificationFailed, match=r"the int8 variant differs from float32 eager on example inputs .*"
                       r"output\[0\]: relative error [0-9.]+ \(at most 0.02\)"):  # fmt: skip
        verify_variant(block, samples, noisy, "int8", LIMIT)
    with pytest.raises(
        VerificationFailed, match=r"output\[0\]: eager torch.float32\[2, 4\], compiled torch.bfloat16\[2, 4\]"
    ):
        verify_variant(block, samples, lambda t: (block(t)[0].bfloat16(), block(t)[1]), "bfloat16", LIMIT)


def test_the_cache_takes_a_variants_record_with_its_own_errors() -> None:
    """A variant's errors are its relative error and cosine: a record of them is a hit, not a damaged entry."""
    from hatch_aoti.store.cache import record_problem

    files = {"m.so": "0" * 64}
    report = {"passed": True, "precision": "bfloat16", "rel_error": 0.02, "cosine": 0.999, "tried": []}
    entry = {"call": [], "cpu": HERE, "device": "cpu", "file": "m.so", "files": files, "backend": "aoti"}
    record = {"entry": {**entry, "verification": report}, "files": files}
    assert record_problem({**record, "errors": {"rel_error": 0.005, "cosine": 0.99999}}, "aoti") is None
    assert record_problem({**record, "errors": {"rel_error": "0.005"}}, "aoti") == "has unusable errors"
    plain = {**record, "entry": {**entry, "verification": {"passed": True, "tried": []}}}
    assert record_problem({**plain, "errors": {"max_abs_err": 1e-6, "max_rel_err": 1e-5}}, "aoti") is None
