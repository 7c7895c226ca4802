"""Platform tag and CPU-target checks: unit tests with injected inputs."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO

from hatch_aoti.pipeline.tagging import ElfNeeds, tag_for
from hatch_aoti.settings.constants import HATCH_TABLE
from hatch_aoti.settings.cpu_targets import (
    X86_64_V3,
    X86_64_V4,
    default_target,
    resolve,
)
from hatch_aoti.settings.reader import ConfigError
from hatch_aoti.settings.resolve import parse_settings

GOMP = {"libgomp.so.1": {"GOMP_4.0", "OMP_1.0", "GOMP_1.0"}, "libtorch_cpu.so": set()}


def needs(glibc: str = "2.17", glibcxx: str = "3.4.19", extra: dict | None = None) -> ElfNeeds:
    return ElfNeeds(
        "x86_64",
        {
            "libc.so.6",
            "libstdc++.so.6",
            "libgcc_s.so.1",
            "ld-linux-x86-64.so.2",
            "libtorch_cpu.so",
            "libgomp.so.1",
            *(extra or {}),
        },
        {
            "libc.so.6": {f"GLIBC_{glibc}", "GLIBC_2.2.5"},
            "libstdc++.so.6": {f"GLIBCXX_{glibcxx}", "CXXABI_1.3"},
            "libgcc_s.so.1": {"GCC_3.0"},
            "libgomp.so.1": {"GOMP_4.0"},
            **(extra or {}),
        },
    )


@pytest.mark.parametrize(
    ("glibc", "glibcxx", "tag"),
    [
        ("2.17", "3.4.19", "manylinux_2_17_x86_64"),
        ("2.28", "3.4.19", "manylinux_2_28_x86_64"),
        ("2.34", "3.4.29", "manylinux_2_34_x86_64"),
        ("2.34", "3.4.30", "manylinux_2_35_x86_64"),  # GCC 12's libstdc++ is newer than glibc says
    ],
)
def test_tag_is_the_most_compatible_policy_allowing_every_symbol(glibc: str, glibcxx: str, tag: str) -> None:
    assert tag_for(needs(glibc, glibcxx), GOMP) == (tag, None)


def test_libraries_must_be_allowed_or_shipped_by_torch() -> None:
    tag, why = tag_for(needs(), {})
    assert tag == "linux_x86_64"
    assert "libgomp.so.1 (neither allowed by manylinux nor shipped by torch)" in why
    tag, why = tag_for(needs(), {"libgomp.so.1": {"GOMP_1.0"}, "libtorch_cpu.so": set()})
    assert tag == "linux_x86_64" and "torch's libgomp.so.1 lacks GOMP_4.0" in why
    tag, why = tag_for(needs(extra={"libcudart.so.12": set()}), GOMP)
    assert tag == "linux_x86_64" and "libcudart.so.12" in why


def test_real_libraries_of_this_torch() -> None:
    from hatch_aoti.pipeline.tagging import torch_libraries

    torch = pytest.importorskip("torch")
    provided = torch_libraries(Path(torch.__file__).parent / "lib")
    assert "libtorch_cpu.so" in provided
    assert "libgomp.so.1" in provided and "GOMP_4.0" in provided["libgomp.so.1"]


# -- CPU targets -----------------------------------------------------------------------


def test_default_targets_and_native() -> None:
    assert default_target("x86_64") == "x86-64-v3"
    assert default_target("aarch64") == "armv8-a"
    assert default_target("riscv64") == "native"
    v3 = resolve("x86-64-v3")
    assert v3.inductor_configs == {"cpp.march": "x86-64-v3", "cpp.simdlen": 256, "cpp.vec_isa_ok": True}
    native = resolve("native", "x86_64", {"avx2", "fma", "avx512f", "avx512_vnni", "ht", "sse4_2"})
    assert native.features == ("avx2", "avx512_vnni", "avx512f", "fma", "sse4_2")


def test_cpu_target_config_problems() -> None:
    models = {
        "m": {"factory": "a:b", "inputs": [], "cpu-target": "x86-64-v5", "inductor-configs": {"cpp.simdlen": 512}}
    }
    with pytest.raises(ConfigError) as info:
        parse_settings({"cpu-target": "armv8-a", "models": models}, machine="x86_64")
    found = dict(info.value.problems)
    assert "is for aarch64 machines; this build machine is x86_64" in found[f"{HATCH_TABLE}.cpu-target"]
    assert "did you mean `x86-64-v4`" in found[f"{HATCH_TABLE}.models.m.cpu-target"]
    assert "is set by cpu-target 'armv8-a'" in found[f"{HATCH_TABLE}.models.m.inductor-configs.cpp.simdlen"]


def test_cpu_target_resolution_order() -> None:
    settings = parse_settings(
        {
            "cpu-target": "x86-64-v4",
            "models": {
                "a": {"factory": "a:b", "inputs": []},
                "b": {"factory": "a:b", "inputs": [], "cpu-target": "native", "inductor-configs": {"cpp.simdlen": 256}},
            },
        },
        machine="x86_64",
        flags=set(X86_64_V4),  # an AVX-512 build machine, whatever this one has
    )
    assert [m.cpu_target for m in settings.models] == ["x86-64-v4", "native"]
    assert (
        parse_settings({"models": {"a": {"factory": "a:b", "inputs": []}}}, machine="x86_64").models[0].cpu_target
        == "x86-64-v3"
    )


@pytest.fixture
def loader(tmp_path: Path):
    """The loader package as a build writes it, beside a manifest with no models."""
    from hatch_aoti.pipeline.artifacts import import_package, write_loader

    (tmp_path / "_aoti").mkdir()
    manifest = {"format": 2, "models": {}, "torch": "x", "hatch_aoti": "y"}
    (tmp_path / "_aoti" / "manifest.json").write_text(json.dumps(manifest))
    write_loader(tmp_path, "compiled")
    module = import_package("loader_under_test", tmp_path / "compiled")
    for name in ("host", "packing"):
        importlib.import_module(f"loader_under_test.{name}")
    yield module
    for name in [n for n in sys.modules if n == "loader_under_test" or n.startswith("loader_under_test.")]:
        del sys.modules[name]


def test_isa_check_names_model_target_and_missing_features(loader) -> None:
    cpu = {"target": "x86-64-v4", "arch": "x86_64", "features": list(X86_64_V4)}
    avx2_host = set(X86_64_V3) | {"ht", "sse2"}
    message = loader.host.cpu_problem(cpu, machine="x86_64", flags=avx2_host)
    assert message.startswith("needs a CPU with x86-64-v4 instructions")
    assert "avx512bw, avx512cd, avx512dq, avx512f, avx512vl" in message
    assert loader.host.cpu_problem(cpu, machine="x86_64", flags=set(X86_64_V4)) is None  # enough


def test_isa_check_refuses_another_architecture(loader) -> None:
    cpu = {"target": "x86-64-v3", "arch": "x86_64", "features": list(X86_64_V3)}
    problem = loader.host.cpu_problem(cpu, machine="aarch64", flags={"asimd"})
    assert problem.startswith("was built for x86_64 CPUs") and problem.endswith("this machine is aarch64")


def test_weights_the_loader_cannot_pack_run_dense_with_a_warning_unless_they_run_only_packed(loader) -> None:
    import torch

    def dense():
        return {"w": torch.ones(8, 3, 3, 3), "q": torch.ones(4, 3, 3, 3, dtype=torch.int8), "s": torch.ones(4)}, None

    good = {"w": {"op": "mkldnn::_reorder_convolution_weight", "args": [[1, 1], [1, 1], [1, 1], 1, [1, 3, 8, 8]]}}
    assert loader.packing.packed(torch, "m", good, dense)["w"].is_mkldnn
    broken = {"w": {"op": "mkldnn::_reorder_convolution_weight", "args": [[1, 1], "no"]}}
    with pytest.warns(RuntimeWarning, match="'m': torch .* could not pack its weights for this CPU"):
        assert loader.packing.packed(torch, "m", broken, dense) == {}
    int8 = {"op": "onednn::qconv_prepack", "args": [{"constant": "s"}, 1.0, 0, [1, 1], [1, 1], [1, 1], 1, None]}
    assert loader.packing.packed(torch, "m", {"q": int8}, dense)["q"].is_mkldnn
    by_value = {**int8, "args": [{"values": [1.0] * 4, "dtype": "float32"}, *int8["args"][1:]]}
    assert loader.packing.packed(torch, "m", {"q": by_value}, dense)["q"].is_mkldnn
    with pytest.raises(RuntimeError, match=r"'m': .* could not pack its weight q \(onednn::qconv_prepack\)"):
        loader.packing.packed(torch, "m", {**good, "q": {**int8, "args": []}}, dense)

    def unreadable() -> tuple[dict[str, torch.Tensor], None]:
        raise OSError("the library's weights could not be read")

    with pytest.warns(RuntimeWarning, match="'m': torch .* could not pack its weights for this CPU"):
        assert loader.packing.packed(torch, "m", good, unreadable) == {}
    with pytest.raises(RuntimeError, match="could not pack its weights for this CPU .*, and it runs only packed"):
        loader.packing.packed(torch, "m", {**good, "q": int8}, unreadable)
    with pytest.raises(RuntimeError, match="mkldnn::no_such_packing is not a packing op this loader runs"):
        loader.packing.packed(torch, "m", {"w": {"op": "mkldnn::no_such_packing", "args": []}}, dense)


def test_hatch_aoti_pack_chooses_which_recorded_weights_are_packed_at_load(
    loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    conv = {"op": "mkldnn::_reorder_convolution_weight", "args": []}
    linear = {"op": "mkldnn::_reorder_linear_weight", "args": [128]}
    int8 = {"op": "onednn::qlinear_prepack", "args": [None]}  # oneDNN's int8 kernels take only packed weights
    m, plain = {"packing": {"c": conv, "l": linear, "q": int8}}, {}
    chosen = {}
    for choice in ("", " ", "convolutions", "all", "none"):
        monkeypatch.setenv("HATCH_AOTI_PACK", choice)
        chosen[choice] = loader.packing.chosen(m)
        assert loader.packing.chosen(plain) == {}
    assert chosen[""] == chosen[" "] == chosen["convolutions"] == {"c": conv, "q": int8}, "convolutions by default"
    assert chosen["all"] == {"c": conv, "l": linear, "q": int8} and chosen["none"] == {"q": int8}
    monkeypatch.setenv("HATCH_AOTI_PACK", "linear")
    with pytest.raises(ValueError, match="HATCH_AOTI_PACK='linear': expected one of convolutions, all, none"):
        loader.packing.chosen(m)


def test_loader_keyerror_lists_known_names(loader) -> None:
    with pytest.raises(KeyError, match="known models: none"):
        loader.load("missing")
    assert loader.names() == ()


def test_the_loader_says_which_hatch_aoti_wrote_it(loader, tmp_path: Path) -> None:
    from hatch_aoti import __version__

    for module in (tmp_path / "compiled").glob("*.py"):
        assert module.read_text().startswith(f"# Written by hatch-aoti {__version__} "), module.name


def test_a_manifest_of_another_format_is_refused_with_what_to_do(loader, tmp_path: Path) -> None:
    """Its fields may mean something else: nothing of it is read."""
    path = tmp_path / "_aoti" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format": 3, "hatch_aoti": "9.0"}))
    newer = r"format 3 \(written by hatch-aoti 9.0\); this loader reads format 2: a newer hatch-aoti wrote it"
    with pytest.raises(RuntimeError, match=newer):
        loader.names()
    path.write_text(json.dumps({"models": {}}))
    with pytest.raises(RuntimeError, match="manifest format None; this loader reads format 2: reinstall the package"):
        loader.load("m")


def test_wheel_defaults_then_target_then_user_configs() -> None:
    from hatch_aoti.backends.aoti import inductor_configs

    (plain, custom) = parse_settings(
        {
            "models": {
                "a": {"factory": "a:b", "inputs": []},
                "b": {
                    "factory": "a:b",
                    "inputs": [],
                    "cpu-target": "x86-64-v4",
                    "inductor-configs": {"aot_inductor.enable_line_tables": True, "max_autotune": False},
                },
            }
        },
        machine="x86_64",
        flags=set(X86_64_V4),
    ).models
    fixed = {
        "cpp.dynamic_threads": True,
        "aot_inductor.model_name_for_generated_files": "model",
        "size_asserts": False,
        "cpp.vec_isa_ok": True,
    }
    assert inductor_configs(plain.inductor_configs, resolve(plain.cpu_target)) == {
        "aot_inductor.enable_line_tables": False,
        "cpp.march": "x86-64-v3",
        "cpp.simdlen": 256,
        **fixed,
    }
    assert inductor_configs(custom.inductor_configs, resolve(custom.cpu_target)) == {
        "aot_inductor.enable_line_tables": True,
        "cpp.march": "x86-64-v4",
        "cpp.simdlen": 512,
        "max_autotune": False,
        **fixed,
    }


def test_own_identity_covers_code_and_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hatch_aoti import __version__
    from hatch_aoti.worker import fingerprint

    fingerprint.own_identity.cache_clear()
    before = fingerprint.own_identity()
    assert before.split()[0] == __version__ and len(before.split()[1]) == 64
    templates = tmp_path / "templates"
    shutil.copytree(REPO / "templates", templates)
    monkeypatch.setattr("hatch_aoti.pipeline.artifacts.template_path", lambda name: templates / name)
    fingerprint.own_identity.cache_clear()
    finder = templates / "editable_finder.py"
    finder.write_text(finder.read_text() + "\n# changed\n")
    try:
        assert fingerprint.own_identity() != before, "a changed template must change every key"
    finally:
        fingerprint.own_identity.cache_clear()


def test_a_loader_imported_again_under_its_name_is_all_its_own(tmp_path: Path) -> None:
    """``hatch-aoti`` may load two wheels' loaders under one name in a process: each runs its own modules."""
    from hatch_aoti.pipeline.artifacts import import_package, write_loader

    copies = []
    for which in ("a", "b"):
        (tmp_path / which / "_aoti").mkdir(parents=True)
        (tmp_path / which / "_aoti" / "manifest.json").write_text(json.dumps({"format": 2, "models": {}}))
        write_loader(tmp_path / which, "compiled")
        copies.append(import_package("twice.compiled", tmp_path / which / "compiled"))
        importlib.import_module("twice.compiled.host")
    try:
        for name in ("twice.compiled.schema", "twice.compiled.host"):
            assert sys.modules[name].__file__.startswith(str(tmp_path / "b")), name
        assert copies[1].names() == ()
    finally:
        for name in [n for n in sys.modules if n.startswith("twice.")]:
            del sys.modules[name]
