"""sample_project built with `python -m build` (sdist, then the wheel from that sdist)."""

from __future__ import annotations

import json
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import Runtime, debug_sections, run
from packaging.tags import parse_tag

pytestmark = pytest.mark.integration


def test_wheel_is_tagged_for_the_platform(sample_dists: tuple[Path, Path]) -> None:
    wheel = sample_dists[1]
    tag = wheel.name.removesuffix(".whl").split("-", 2)[2]
    (parsed,) = parse_tag(tag)
    assert (parsed.interpreter, parsed.abi) == ("py3", "none")
    assert parsed.platform.startswith("manylinux_2_") and parsed.platform != "any"
    with zipfile.ZipFile(wheel) as zf:
        wheel_meta = zf.read("sample_models-0.1.0.dist-info/WHEEL").decode()
        metadata = zf.read("sample_models-0.1.0.dist-info/METADATA").decode()
        names = zf.namelist()
    assert "Root-Is-Purelib: false" in wheel_meta
    assert f"Tag: {tag}" in wheel_meta
    assert "Requires-Dist: torch==2.13.*" in metadata
    assert "sample_models/compiled/__init__.py" in names and "sample_models/compiled/engine.py" in names
    assert "sample_models/_aoti/manifest.json" in names
    assert any(n.startswith("sample_models/_aoti/mlp/") and n.endswith(".so") for n in names)


def test_sdist_carries_sources_not_artifacts(sample_dists: tuple[Path, Path]) -> None:
    with tarfile.open(sample_dists[0]) as tf:
        names = tf.getnames()
    assert any(n.endswith("src/sample_models/models.py") for n in names)
    assert any(n.endswith("src/sample_models/weights.pt") for n in names)
    assert not any("_aoti" in n or "compiled" in n.split("/") or n.endswith(".so") for n in names)


def test_compiled_models_match_eager(sample_installed: Runtime) -> None:
    result = sample_installed.json(
        """
        import json, torch
        from sample_models import compiled
        from sample_models.models import build_mlp, build_classifier
        torch.manual_seed(0)
        out = {}
        with torch.inference_mode():
            x = torch.randn(4, 128)
            y = compiled.load("mlp")(x)
            out["mlp"] = [type(y).__name__, list(y.shape), (y - build_mlp()(x)).abs().max().item()]
            clf, eager = compiled.load("classifier"), build_classifier()
            for batch in (1, 7, 64):
                x = torch.rand(batch, 3, 16, 16)
                got, ref = clf(x), eager(x)
                out[f"classifier{batch}"] = [type(got).__name__, [list(t.shape) for t in got],
                                             max((a - b).abs().max().item() for a, b in zip(got, ref))]
        print(json.dumps(out))
        """
    )
    assert result["mlp"][:2] == ["Tensor", [4, 10]] and result["mlp"][2] < 1e-5
    for batch in (1, 7, 64):
        kind, shapes, err = result[f"classifier{batch}"]
        assert kind == "tuple" and shapes == [[batch, 5], [batch, 5]] and err < 1e-5


def test_names_info_and_unknown_name(sample_installed: Runtime) -> None:
    result = sample_installed.json(
        """
        import hashlib, json, sys
        from sample_models import compiled
        info = compiled.info("classifier")
        try:
            compiled.load("nope")
            error = None
        except KeyError as exc:
            error = str(exc)
        digest = hashlib.sha256(open(info["file"], "rb").read()).hexdigest()
        print(json.dumps({"names": compiled.names(), "info": info, "error": error, "digest": digest,
                          "hatch_aoti_imported": any(m.startswith("hatch_aoti") for m in sys.modules)}))
        """
    )
    assert result["names"] == ["mlp", "classifier"]
    info = result["info"]
    assert info["torch"].startswith("2.13.") and info["device"] == "cpu"
    assert info["dynamic"] == {"batch": {"min": 1, "max": 64}}
    assert info["inputs"]["args"] == [{"shape": ["batch", 3, 16, 16], "dtype": "float32"}]
    assert info["sha256"] == result["digest"]
    assert info["verification"]["passed"] is True
    assert {t["inputs"] for t in info["verification"]["tried"]} == {"example", "min", "mid", "max"}
    assert "'mlp'" in result["error"] and "'classifier'" in result["error"] and "nope" in result["error"]
    assert result["hatch_aoti_imported"] is False


def test_load_is_shared_and_thread_safe(sample_installed: Runtime) -> None:
    result = sample_installed.json(
        """
        import json, threading, torch
        from sample_models import compiled
        from sample_models.models import build_mlp
        barrier, ids, errors = threading.Barrier(8), [], []
        eager = build_mlp()
        def worker(seed):
            barrier.wait()
            model = compiled.load("mlp")
            ids.append(id(model))
            gen = torch.Generator().manual_seed(seed)
            with torch.inference_mode():
                for _ in range(50):
                    x = torch.randn(4, 128, generator=gen)
                    errors.append((model(x) - eager(x)).abs().max().item())
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        [t.start() for t in threads]; [t.join() for t in threads]
        print(json.dumps({"ids": len(set(ids)), "calls": len(errors), "max_err": max(errors),
                          "same": compiled.load("mlp") is compiled.load("mlp")}))
        """
    )
    assert result.pop("max_err") < 1e-5
    assert result == {"ids": 1, "calls": 400, "same": True}


def test_save_pt2_is_a_standard_package(sample_installed: Runtime, tmp_path: Path) -> None:
    result = sample_installed.json(
        f"""
        import json, torch, torch._inductor
        from sample_models import compiled
        path = compiled.save_pt2("classifier", {str(tmp_path / "classifier.pt2")!r})
        public = torch._inductor.aoti_load_package(path)
        x = torch.rand(3, 3, 16, 16)
        with torch.inference_mode():
            a, b = public(x), compiled.load("classifier")(x)
        print(json.dumps(max((p - q).abs().max().item() for p, q in zip(a, b))))
        """
    )
    assert result == 0.0


def test_fallback_to_public_loader_warns_once_and_works(sample_installed: Runtime) -> None:
    result = sample_installed.json(
        """
        import json, warnings, torch
        del torch._C._aoti.AOTIModelContainerRunnerCpu   # a torch without the private runner
        del torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors  # nor the handles of its C interface
        from sample_models import compiled
        from sample_models.models import build_mlp
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = compiled.load("mlp")
            compiled.load("mlp")
        x = torch.randn(4, 128)
        with torch.inference_mode():
            err = (model(x) - build_mlp()(x)).abs().max().item()
        ours = [str(w.message) for w in caught if "falling back" in str(w.message)]
        print(json.dumps({"warnings": ours, "err": err}))
        """
    )
    assert len(result["warnings"]) == 1 and "'mlp'" in result["warnings"][0]
    assert result["err"] < 1e-5


def test_bad_calls_raise_python_errors_naming_model_and_expectation(sample_installed: Runtime) -> None:
    result = sample_installed.json(
        """
        import json, numpy, torch
        from sample_models import compiled
        mlp, clf = compiled.load("mlp"), compiled.load("classifier")
        calls = {
            "count": lambda: mlp(torch.randn(4, 128), torch.randn(4, 128)),
            "none": lambda: mlp(),
            "kwarg": lambda: mlp(inputs=torch.randn(4, 128)),  # forward takes x
            "rank": lambda: mlp(torch.randn(4, 128, 1)),
            "size": lambda: mlp(torch.randn(5, 128)),
            "dtype": lambda: mlp(torch.randn(4, 128, dtype=torch.float64)),
            "device": lambda: mlp(torch.empty(4, 128, device="meta")),
            "not_tensor": lambda: mlp([[0.0] * 128] * 4),
            "numpy": lambda: mlp(numpy.zeros((4, 128), dtype=numpy.float32)),
            "numpy_dynamic": lambda: clf(numpy.zeros((2, 3, 16, 16), dtype=numpy.float32)),
            "above_max": lambda: clf(torch.rand(65, 3, 16, 16)),
            "below_min": lambda: clf(torch.rand(0, 3, 16, 16)),
            "static_dim": lambda: clf(torch.rand(2, 3, 16, 15)),
        }
        out = {"by_name": mlp(x=torch.ones(4, 128)).tolist() == mlp(torch.ones(4, 128)).tolist()}
        for key, call in calls.items():
            try:
                call()
                out[key] = None
            except Exception as exc:
                out[key] = [type(exc).__name__, str(exc)]
        print(json.dumps(out))
        """
    )
    expected_type = {
        "count": "TypeError",
        "none": "TypeError",
        "kwarg": "TypeError",
        "rank": "ValueError",
        "size": "ValueError",
        "dtype": "TypeError",
        "device": "TypeError",
        "not_tensor": "TypeError",
        "numpy": "TypeError",
        "numpy_dynamic": "TypeError",
        "above_max": "ValueError",
        "below_min": "ValueError",
        "static_dim": "ValueError",
    }
    for key, kind in expected_type.items():
        assert result[key] is not None, f"{key}: the bad call was accepted"
        assert result[key][0] == kind, (key, result[key])
        model = "'classifier'" if key in ("above_max", "below_min", "static_dim", "numpy_dynamic") else "'mlp'"
        assert f"compiled model {model}" in result[key][1], (key, result[key])
    assert result["by_name"] is True, "an input passed by its name in forward"
    assert "(unexpected: ['inputs'])" in result["kwarg"][1]
    assert "float32 on cpu with shape [4, 128]; got float64" in result["dtype"][1]
    assert "got float32 on meta" in result["device"][1]
    assert "must be a tensor (float32 on cpu with shape [4, 128]); got ndarray" in result["numpy"][1]
    assert "batch in [1, 64]" in result["above_max"][1] and "[65, 3, 16, 16]" in result["above_max"][1]


def test_load_writes_no_files(sample_installed: Runtime, tmp_path: Path) -> None:
    import os

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    site = sample_installed.json(
        "import json, sample_models, os; print(json.dumps(os.path.dirname(sample_models.__file__)))"
    )
    before = sorted(os.listdir(site))
    proc = run(
        [
            str(sample_installed.python),
            "-c",
            "import torch; from sample_models import compiled; compiled.load('mlp')(torch.randn(4, 128));"
            "compiled.load('classifier')(torch.rand(2, 3, 16, 16))",
        ],
        env={**os.environ, "TMPDIR": str(tmpdir), "PYTHONDONTWRITEBYTECODE": "1"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0
    assert list(tmpdir.iterdir()) == []
    assert sorted(os.listdir(site)) == before


def test_default_target_has_no_avx512_instructions(sample_dists: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils) is needed for this check"
    libraries, manifest = extract_libraries(sample_dists[1], tmp_path)
    listings = {name: run([objdump, "-d", "--no-show-raw-insn", str(tmp_path / name)]).stdout for name in libraries}
    # a model of oneDNN calls alone (mlp's linear layers, prepacked) has no vector code of its own
    assert any("ymm" in listing for listing in listings.values()), "expected AVX2 code: the check would be vacuous"
    for name, listing in listings.items():
        assert "zmm" not in listing, f"{name} uses AVX-512 registers"
    for entry in manifest["models"].values():
        assert entry["cpu"]["target"] == "x86-64-v3" and "avx2" in entry["cpu"]["features"]
        assert "avx512f" not in entry["cpu"]["features"]


def test_libraries_ship_without_debug_sections(sample_dists: tuple[Path, Path], tmp_path: Path) -> None:
    libraries, manifest = extract_libraries(sample_dists[1], tmp_path)
    for name in libraries:
        assert debug_sections(tmp_path / name) == [], f"{name} carries debug sections"
    for entry in manifest["models"].values():
        assert entry["inductor_configs"]["aot_inductor.enable_line_tables"] is False


def extract_libraries(wheel: Path, dest: Path) -> tuple[list[str], dict]:
    """The wheel's two compiled libraries, extracted under ``dest``, and its manifest."""
    with zipfile.ZipFile(wheel) as zf:
        libraries = [n for n in zf.namelist() if n.endswith(".so")]
        zf.extractall(dest, libraries)
        manifest = json.loads(zf.read("sample_models/_aoti/manifest.json"))
    assert len(libraries) == 2
    return libraries, manifest


def test_auditwheel_agrees_with_the_tag(sample_dists: tuple[Path, Path]) -> None:
    wheel = sample_dists[1]
    report = json.loads(run([sys.executable, "-m", "auditwheel", "show", "--json", str(wheel)]).stdout)
    ours = wheel.name.removesuffix(".whl").split("-")[-1]
    assert report["sym_tag"] == ours, "the symbol versions the libraries use give exactly our tag"
    assert set(report["external_libs"]) <= {"libtorch_cpu.so", "libgomp.so.1", "libc10.so"}, (
        "everything outside the manylinux list must be shipped by torch"
    )
    assert report["unsupported_isa"] is False


def test_twine_check_and_check_wheel_contents(sample_dists: tuple[Path, Path]) -> None:
    run([sys.executable, "-m", "twine", "check", "--strict", str(sample_dists[1])])
    proc = run([sys.executable, "-m", "check_wheel_contents", str(sample_dists[1])])
    assert "OK" in proc.stdout
