"""Backends: aoti, precompile and a third-party one in one wheel; pins, version checks, the interface."""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import TOY, Runtime

from hatch_aoti.backends import Backend, Pins, combined_pins

pytestmark = pytest.mark.integration


def test_the_wheel_pins_what_its_strictest_model_needs(mixed_wheel: tuple[Path, str]) -> None:
    wheel, output = mixed_wheel
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name.startswith(f"mixpkg-1.0-{python}-none-manylinux_2_"), "precompiled code needs this Python"
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read("mixpkg-1.0.dist-info/METADATA").decode()
        names = zf.namelist()
    assert "Requires-Dist: torch==2.13.0\n" in metadata, "an exact torch: precompiled code loads on no other"
    assert "mixpkg/_aoti/runtime/export.py" in names, "the third-party backend's run-time module ships"
    assert "mixpkg/_aoti/runtime/precompile.py" not in names
    for place, model in enumerate(("fast", "guarded", "batched", "plain"), start=1):
        assert f"aoti: [{place}/4] {model}: compiled in" in output


def test_the_builtin_backends_keep_inductors_precompiled_headers_in_the_store(mixed_wheel: tuple[Path, str]) -> None:
    """Inductor keys its precompiled headers (over 100 MB each) by the torch install's path, and an
    isolated build's install is new each time: outside the store, each build would leave one."""
    (headers,) = (mixed_wheel[0].parent.parent / "tmp").glob("torchinductor_*/precompiled_headers")
    assert list(headers.glob("*.gch")) == []
    assert list(headers.glob("hatch-aoti/*/*.gch")), "aoti and precompile builds use precompiled headers"


def test_every_backend_matches_eager_with_only_torch(mixed_site: Path, runtime: Runtime) -> None:
    result = runtime.json(
        f"""
        import json, sys; sys.path.insert(0, {str(mixed_site)!r})
        import torch
        from mixpkg import compiled, models
        out = {{"backends": {{n: compiled.info(n)["backend"] for n in compiled.names()}}}}
        x, scale = torch.randn(2, 8), torch.rand(2, 1)
        with torch.inference_mode():                      # precompiled models too, made and called in it
            for name in ("fast", "guarded"):
                got, want = compiled.load(name)(x, scale=scale), models.scaled()(x, scale=scale)
                out[name] = max((got[k] - want[k]).abs().max().item() for k in want)
            for name in ("batched", "plain"):
                for batch in (2, 7, 32):
                    xb = torch.randn(batch, 8)
                    out[f"{{name}}{{batch}}"] = (compiled.load(name)(xb) - models.mlp()(xb)).abs().max().item()
            xt = torch.randn(8, 5).t()                    # another layout: copied, not computed wrong
            column = torch.rand(1, 2).t()                 # contiguous, with another stride for its size-1 dim
            for name in ("fast", "guarded"):              # (precompiled: the transposed view failed its guards)
                got, want = compiled.load(name)(xt[:2], scale=column), models.scaled()(xt[:2], scale=column)
                out[f"{{name}}_transposed"] = max((got[k] - want[k]).abs().max().item() for k in want)
            for name in ("batched", "plain"):
                out[f"{{name}}_transposed"] = (compiled.load(name)(xt) - models.mlp()(xt)).abs().max().item()
        try:
            compiled.load("batched")(torch.randn(33, 8))
        except ValueError as exc:
            out["too_big"] = str(exc)
        out["needs"], out["factory"] = compiled.info("guarded")["needs"], compiled.info("guarded")["factory"]
        out["imported"] = sorted(m for m in sys.modules if m.startswith(("hatch_aoti", "toy_backend")))
        print(json.dumps(out))
        """
    )
    assert result["backends"] == {"fast": "aoti", "guarded": "precompile", "batched": "precompile", "plain": "export"}
    errors = {k: v for k, v in result.items() if k.startswith(("fast", "guarded", "batched", "plain"))}
    assert len(errors) == 12 and max(errors.values()) < 1e-5, errors
    assert "'batched'" in result["too_big"] and "batch in [2, 32]" in result["too_big"]
    assert result["needs"]["module"].startswith("built by the model's factory (`factory`) when the model is loaded")
    assert result["factory"] == "mixpkg.models:scaled"
    assert result["needs"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert result["imported"] == [], "the wheel needs neither hatch-aoti nor the backend's package"


def test_a_precompiled_model_refuses_another_python_or_torch(
    mixed_site: Path, runtime: Runtime, tmp_path: Path
) -> None:
    """Simulated by editing the manifest of an installed copy: a clear error naming both, no crash."""
    site = tmp_path / "site"
    shutil.copytree(mixed_site, site)
    manifest_path = site / "mixpkg" / "_aoti" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["models"]["guarded"]["torch"] = "2.12.0+cpu"
    manifest["models"]["batched"]["python"] = "3.10.4"
    manifest_path.write_text(json.dumps(manifest))
    result = runtime.json(
        f"""
        import json, sys; sys.path.insert(0, {str(site)!r})
        from mixpkg import compiled
        out = {{}}
        for name in ("guarded", "batched"):
            try:
                compiled.load(name)
            except RuntimeError as exc:
                out[name] = str(exc)
        print(json.dumps(out))
        """
    )
    python = ".".join(map(str, sys.version_info[:3]))
    assert (
        f"with Python {python} and torch 2.12.0+cpu, and loads only there; this is Python {python} with torch 2.13.0"
        in result["guarded"]
    )
    assert (
        f"with Python 3.10.4 and torch 2.13.0+cpu, and loads only there; this is Python {python}" in result["batched"]
    )


# -- the interface, without compiling ----------------------------------------------------


def test_the_narrowest_pin_wins() -> None:
    series, exact = Pins("torch==2.13.*"), Pins("torch==2.13.0", "cp311")
    assert combined_pins([series]) == series
    assert combined_pins([series, exact]) == Pins("torch==2.13.0", "cp311")
    with pytest.raises(ValueError, match="cp310, cp311"):
        combined_pins([exact, Pins("torch==2.13.0", "cp310")])


def test_precompile_takes_any_range_but_no_rules() -> None:
    from hatch_aoti.backends.precompile import PrecompileBackend
    from hatch_aoti.settings.resolve import parse_settings

    table = {
        "models": {
            "m": {
                "factory": "a:b",
                "backend": "precompile",
                "inputs": [{"shape": ["n", "k"]}],
                "dynamic": {"n": {"min": 0, "max": 8}, "k": "2*n"},
            }
        }
    }
    (spec,) = parse_settings(table, machine="x86_64", flags=set()).models
    ((path, message),) = PrecompileBackend().check(spec)
    assert path.endswith("models.m.dynamic.k") and "the precompile backend cannot compile" in message


def test_what_a_backend_cannot_compile_is_listed_with_the_readers_problems() -> None:
    from hatch_aoti import backends
    from hatch_aoti.settings.constants import HATCH_TABLE
    from hatch_aoti.settings.reader import ConfigError
    from hatch_aoti.settings.resolve import parse_settings

    table = {
        "backend": "precompile",
        "models": {
            "ruled": {"factory": "a:b", "inputs": [{"shape": ["n", "k"]}], "dynamic": {"n": {"max": 8}, "k": "2*n"}},
            "typo": {"factory": "a:b", "inputs": [{"shape": [2]}], "rtol": "tight"},
            "a.b": {"factory": "a:b", "inputs": [{"shape": [2]}], "tune": True},
        },
    }
    with pytest.raises(ConfigError) as info:
        parse_settings(table, machine="x86_64", flags=set(), backend_check=backends.problems)
    found = dict(info.value.problems)
    quoted = f'{HATCH_TABLE}.models."a.b"'  # a name that needs quoting is quoted in every path
    assert set(found) == {
        f"{HATCH_TABLE}.models.ruled.dynamic.k",
        f"{HATCH_TABLE}.models.typo.rtol",
        quoted,
        f"{quoted}.tune",
    }, found
    assert "the precompile backend cannot compile" in found[f"{HATCH_TABLE}.models.ruled.dynamic.k"]


def test_unknown_backends_are_named_with_the_installed_ones() -> None:
    from hatch_aoti.settings.constants import HATCH_TABLE
    from hatch_aoti.settings.reader import ConfigError
    from hatch_aoti.settings.resolve import parse_settings

    with pytest.raises(ConfigError) as info:
        parse_settings({"backend": "aotx", "models": {"m": {"factory": "a:b", "inputs": [], "backend": "tvm"}}})
    found = dict(info.value.problems)
    assert (
        "unknown backend 'aotx' (did you mean `aoti`?); installed backends: aoti, precompile"
        in found[f"{HATCH_TABLE}.backend"]
    )
    assert "installed backends: aoti, precompile" in found[f"{HATCH_TABLE}.models.m.backend"]


def test_a_backend_is_a_small_object() -> None:
    sys.path.insert(0, str(TOY))
    try:
        from toy_backend import ExportBackend
    finally:
        sys.path.remove(str(TOY))
    backend = ExportBackend()
    assert isinstance(backend, Backend) and backend.runtime.is_file() and backend.in_helpers
    assert backend.pins("2.13.0+cpu") == Pins("torch==2.13.*", "py3"), "the defaults: the series, any Python 3"
