"""Large models: mapped weights, a torchao int8 model, and a disk that fills up."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TABLES, Runtime, build_no_isolation, write_project

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

MODELS = """
    import torch
    from torch import nn

    def wide():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048)).eval()

    class Fused(nn.Module):
        # Weights that share storage: q, k and v are views of one fused parameter (as a checkpoint
        # loaded with `assign=True` can give), and `t` a transposed view at an offset.

        def __init__(self):
            super().__init__()
            qkv = torch.randn(3 * 64, 64)
            self.q, self.k, self.v = (nn.Parameter(w) for w in qkv.split(64))
            self.t = nn.Parameter(torch.randn(80, 64)[16:].t())

        def forward(self, x):
            return x @ self.q.T + (x @ self.k.T) * (x @ self.v.T) + x @ self.t

    def fused():
        torch.manual_seed(2)
        return Fused().eval()

    def quantized():
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)).eval()
        quantize_(model, Int8WeightOnlyConfig())
        return model
"""
HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti.models.wide]
    factory = "largepkg.models:wide"
    inputs = [{ shape = ["batch", 2048] }]
    dynamic = { batch = { min = 1, max = 8 } }
    weights = "mapped"

    [tool.hatch.build.targets.wheel.hooks.aoti.models.quantized]
    factory = "largepkg.models:quantized"
    inputs = [{ shape = [4, 64] }]

    [tool.hatch.build.targets.wheel.hooks.aoti.models.fused]
    factory = "largepkg.models:fused"
    inputs = [{ shape = [4, 64] }]
    weights = "mapped"
    inductor-configs = { freezing = false }  # the weights as the module has them, views included
"""
WEIGHTS = 4 * (2 * 2048 * 4096 + 4096 + 2048)  # 64 MiB


@pytest.fixture(scope="session")
def large_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(tmp_path_factory.mktemp("large") / "proj", "largepkg", HOOK, {"models.py": MODELS})


@pytest.fixture(scope="session")
def large_site(large_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    build_no_isolation(large_project, large_project / "dist")
    (wheel,) = (large_project / "dist").glob("*.whl")
    site = tmp_path_factory.mktemp("large-site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


MEASURE = """
import json, sys
sys.path.insert(0, {site!r})
def status():
    return {{k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in open("/proc/self/status"))
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}}
import torch
from largepkg import compiled
compiled.load("quantized")(torch.randn(4, 64))  # the loader's own cost, paid once: not the model's
torch.manual_seed(3)
x = torch.randn(8, 2048)
before = status()
y = compiled.load("wide")(x)
after = status()
mapped = any(line.rstrip().endswith("weights.bin") for line in open("/proc/self/maps"))
from largepkg.models import wide
err = (y - wide()(x)).abs().max().item()
print(json.dumps({{"before": before, "after": after, "mapped": mapped, "err": err,
                   "info": compiled.info("wide")["weights"]["file"]}}))
"""


def test_mapped_weights_are_shared_not_copied(large_site: Path, runtime: Runtime) -> None:
    """Measured in a fresh process, after the loader's first model: the weights file is mapped,
    and load plus first call add at most 1.15x the weights to the process (about 1x: pages of
    the page cache, shared with every process that maps them)."""
    result = runtime.json(MEASURE.format(site=str(large_site)))
    assert result["err"] < 1e-5 and result["mapped"], result
    before, after = result["before"], result["after"]
    assert after["VmHWM"] - before["VmRSS"] <= 1.15 * WEIGHTS, (after, before)
    assert after["RssFile"] - before["RssFile"] >= 0.9 * WEIGHTS, "the weights are read through the mapping"
    assert after["RssAnon"] - before["RssAnon"] <= 0.15 * WEIGHTS, "and not copied into the process"
    assert result["info"] == "weights.bin"


@pytest.mark.parametrize("name, size", [("wide", 2048), ("fused", 64)])
def test_mapped_weights_round_trip_through_torch_loaders(
    large_site: Path, runtime: Runtime, tmp_path: Path, name: str, size: int
) -> None:
    """The installed model, its ``save_pt2()`` package under torch's own loader, and torch's loader as the
    loader's fallback all give what eager gives; ``fused``'s weights share storage and are views."""
    import torch

    sys.path.insert(0, str(large_site))
    try:
        from largepkg import models
    finally:
        sys.path.remove(str(large_site))
    torch.manual_seed(5)
    x = torch.randn(3 if name == "wide" else 4, size)
    with torch.no_grad():
        expected = getattr(models, name)()(x)
    torch.save(x, tmp_path / "x.pt")
    result = runtime.json(
        f"""
        import json, sys, warnings; sys.path.insert(0, {str(large_site)!r})
        import torch
        from torch.export.pt2_archive._package import load_pt2
        from largepkg import compiled
        x = torch.load({str(tmp_path / "x.pt")!r})
        ours = compiled.load({name!r})(x)
        torch.save(ours, {str(tmp_path / "ours.pt")!r})
        (public,) = load_pt2(compiled.save_pt2({name!r}, {str(tmp_path / "m.pt2")!r}),
                             load_weights_from_disk=True).aoti_runners.values()
        out = {{"save_pt2": (public(x) - ours).abs().max().item()}}
        del torch._C._aoti.AOTIModelContainerRunnerCpu          # torch's own loader, as a fallback
        del torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
        compiled._LOADED.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["fallback"] = (compiled.load({name!r})(x) - ours).abs().max().item()
        out["fallback_runner"] = type(compiled.load({name!r}).runner).__name__
        print(json.dumps(out))
        """
    )
    assert result == {"save_pt2": 0.0, "fallback": 0.0, "fallback_runner": "AOTICompiledModel"}
    torch.testing.assert_close(torch.load(tmp_path / "ours.pt"), expected, rtol=1e-4, atol=1e-4)


def test_a_torchao_int8_model_needs_no_torchao_at_run_time(large_site: Path, runtime: Runtime) -> None:
    import torch

    sys.path.insert(0, str(large_site))
    try:
        from largepkg.models import quantized
    finally:
        sys.path.remove(str(large_site))
    torch.manual_seed(4)
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = quantized()(x)
    result = runtime.json(
        f"""
        import json, sys; sys.path.insert(0, {str(large_site)!r})
        import torch
        from largepkg import compiled
        torch.manual_seed(4)
        y = compiled.load("quantized")(torch.randn(4, 64))
        print(json.dumps({{"y": y.tolist(), "torchao": "torchao" in sys.modules,
                           "verified": compiled.info("quantized")["verification"]["passed"]}}))
        """
    )
    assert result["torchao"] is False and result["verified"] is True
    assert torch.allclose(torch.tensor(result["y"]), expected, rtol=1e-4, atol=1e-5)


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("full", ["cache", "staging"])
def test_a_full_disk_fails_the_build_saying_where_and_how_much(
    large_project: Path, tmp_path: Path, full: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    project = tmp_path / "proj"
    import shutil

    shutil.copytree(large_project, project, ignore=shutil.ignore_patterns("dist"))
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().split(f"[{TABLES['hatch']}.models.quantized]")[0])
    with small_disk(tmp_path / "disk", "8m") as disk:
        env = (
            {**os.environ, "HATCH_AOTI_CACHE_DIR": str(disk / "cache")}
            if full == "cache"
            else {**os.environ, "TMPDIR": str(disk), "HATCH_AOTI_CACHE_DIR": str(tmp_path / "cache")}
        )
        proc = build_no_isolation(project, project / "dist", check=False, env=env)
        text = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "Traceback" not in text, text
        assert not list(project.glob("dist/*.whl")), "no wheel"
        where = disk / "cache" if full == "cache" else disk
        assert f"model 'wide' ({TABLES['hatch']}.models.wide) failed at " in text
        assert "not enough disk space in " in text, text
        message = text.split("not enough disk space in ", 1)[1].splitlines()[0]
        assert message.startswith(str(where)) and "MiB needed" in message and "free" in message, message
        if full == "cache":
            assert not [p for p in (disk / "cache" / "v2").rglob("*") if p.is_file()], "no entry, whole or partial"
        else:
            assert [p.name for p in disk.iterdir() if p.name.startswith("hatch-aoti-")] == [], "staging removed"
