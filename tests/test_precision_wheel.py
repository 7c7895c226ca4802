"""One wheel built with ``precision = ["bfloat16", "int8", "float32"]``, calibration samples and mapped
weights, and a model whose int8 variant's convolutions compute in bfloat16: each variant installed and
checked against eager, the loader's choice here and on an emulated CPU without bfloat16, the CLI, and
a rebuild from the cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from hatch_aoti.loader import host
from hatch_aoti.loader.schema import variants_of
from tests.conftest import Runtime, build_no_isolation, run, write_project

TABLE = "tool.hatch.build.targets.wheel.hooks.aoti"

# -- one wheel, three variants ------------------------------------------------------------------------------

HOOK = f"""
[{TABLE}.models.net]
factory = "prec.models:build"
inputs = [{{ shape = ["batch", 3, 32, 32], dtype = "float32" }}]
dynamic = {{ batch = {{ min = 1, max = 16 }} }}
precision = ["bfloat16", "int8", "float32"]
calibration = "prec.models:calibration"
weights = "mapped"

[{TABLE}.models.scaled]
factory = "prec.models:scaled"
inputs = [{{ shape = [4, 8, 64], dtype = "float32" }}]
precision = ["int8", "bfloat16"]
"""

MODELS = """
import torch


class Net(torch.nn.Module):
    # a convolution stem, then a transformer-like block of linear layers: every kind a variant lowers
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 128, 3, stride=2, padding=1), torch.nn.BatchNorm2d(128), torch.nn.ReLU(),
        )
        self.norm = torch.nn.LayerNorm(128)
        self.up = torch.nn.Linear(128, 512)
        self.down = torch.nn.Linear(512, 128)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x):
        h = self.stem(x).flatten(2).transpose(1, 2)
        h = h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))
        return self.head(h.mean(1))


def build():
    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():  # trained-like batch norm statistics
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return net


class Scaled(torch.nn.Module):
    # called by keyword and with a default left out: the loader binds calls to forward's signature;
    # int8 without calibration samples: its convolution computes in bfloat16, the next variant's precision
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x, scale: float = 2.0):
        return self.fc(torch.relu(self.conv(x))) * scale


def scaled():
    torch.manual_seed(0)
    return Scaled().eval()


def calibration():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 32, 32, generator=g) for _ in range(4)]
"""


@pytest.fixture(scope="session")
def precision_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = write_project(tmp_path_factory.mktemp("precision") / "proj", "prec", HOOK, {"models.py": MODELS})
    env = {**os.environ, "HATCH_AOTI_JOBS": "2", "HATCH_AOTI_PRECISION": "int8"}  # the build's loads ignore it
    proc = build_no_isolation(root, root / "dist", env=env)
    (wheel,) = (root / "dist").glob("*.whl")
    return wheel, proc.stderr


@pytest.fixture(scope="session")
def precision_site(
    precision_wheel: tuple[Path, str], runtime: Runtime, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The wheel unpacked beside its project's models (the runtime venv has torch, not hatch-aoti)."""
    site = tmp_path_factory.mktemp("precision-site")
    with zipfile.ZipFile(precision_wheel[0]) as zf:
        zf.extractall(site)
    return site


CHECK = """
import json, os, sys, torch
sys.path.insert(0, os.environ["SITE"])
from prec import compiled, models
eager = models.build()
found = {"info": {k: compiled.info("net")[k] for k in ("precision", "variants", "passed_over")}, "variants": {}}
for batch in (1, 5):
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        expected = eager(x)
    for precision in found["info"]["variants"]:
        try:
            y = compiled.load("net", precision=precision)(x.clone())
        except RuntimeError as exc:
            found["variants"][precision] = str(exc)
            continue
        rel = float((y.double() - expected.double()).norm() / expected.double().norm())
        cos = float(torch.nn.functional.cosine_similarity(y.double().flatten(), expected.double().flatten(), dim=0))
        found["variants"].setdefault(precision, []).append([type(y).__name__, str(y.dtype), list(y.shape), rel, cos])
    y = compiled.load("net")(x.clone())
    found.setdefault("default", []).append(float((y - expected).norm() / expected.norm()))
try:
    compiled.save_pt2("net", os.path.join(os.environ["SITE"], "int8.pt2"), precision="int8")
except (ValueError, RuntimeError) as exc:  # RuntimeError: not on this CPU
    found["save_int8"] = str(exc)
small = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(5))
scaled = compiled.info("scaled")
found["scaled"] = {"precision": scaled["precision"], "passed_over": scaled["passed_over"]}
if scaled["precision"] is not None:
    with torch.no_grad():
        expected = models.scaled()(small)
    y = compiled.load("scaled")(x=small)
    found["scaled"]["rel"] = float((y - expected).norm() / expected.norm())
print(json.dumps(found))
"""


def in_site(runtime: Runtime, site: Path, *prefix: str, env: dict[str, str] | None = None) -> Any:
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HATCH_AOTI_PRECISION")},
        "SITE": str(site),
        **(env or {}),
    }
    proc = run([*prefix, str(runtime.python), "-c", CHECK], env=env, cwd=site)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def has_native_bfloat16() -> bool:
    return host.precision_problem("bfloat16", host.cpuid(torch)) is None


def runs_here(site: Path, precision: str) -> bool:
    """Whether the loader runs the wheel's ``net`` variant here: its precision and its target, as built."""
    manifest = json.loads((site / "prec" / "_aoti" / "manifest.json").read_text(encoding="utf-8"))
    entry = manifest["models"]["net"]
    (variant,) = [v for v in [entry, *entry.get("variants", [])] if v.get("precision", "float32") == precision]
    return host.variant_problem(variant, torch) is None


@pytest.mark.integration
def test_each_variant_is_built_verified_and_matches_eager_in_a_fresh_venv(
    precision_wheel: tuple[Path, str], precision_site: Path, runtime: Runtime
) -> None:
    wheel, log = precision_wheel
    assert "net@bfloat16: compiled" in log and "net@int8: compiled" in log and "[1/2] net: compiled" in log, log
    assert "int8:" in log and "of 2 convolutions" in log, "the build says what int8 quantized"
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("prec/_aoti/net@bfloat16/") for n in names)
    assert any(n.startswith("prec/_aoti/net@int8/") for n in names)
    manifest = json.loads((precision_site / "prec" / "_aoti" / "manifest.json").read_text(encoding="utf-8"))
    net = manifest["models"]["net"]
    variants = {v.get("precision", "float32"): v for v in [net, *net["variants"]]}
    assert all("weights" in v for v in variants.values()), "every variant's weights are mapped, int8's too"
    ops = sorted(how["op"] for how in variants["int8"]["packing"].values())
    assert ops == ["onednn::qconv_prepack"] * 2 + ["onednn::qlinear_prepack"] * 3, ops
    # int8 weights run only packed: packed even where HATCH_AOTI_PACK asks for nothing to be
    found = in_site(runtime, precision_site, env={"HATCH_AOTI_PACK": "none"})
    if runs_here(precision_site, "int8"):  # elsewhere it is refused for the CPU first
        assert "int8 variant's weights are packed for this CPU as it loads" in found["save_int8"]
    assert found["info"]["variants"] == ["bfloat16", "int8", "float32"]
    limits = {"bfloat16": 0.02, "int8": 0.1, "float32": 1e-4}
    for precision, runs in found["variants"].items():
        if isinstance(runs, str):
            assert not runs_here(precision_site, precision), runs
            continue
        for kind, dtype, shape, rel, cos in runs:
            assert (kind, dtype, shape[1:]) == ("Tensor", "torch.float32", [10]), "the float32 model's outputs"
            assert rel <= limits[precision] and cos > 0.99, (precision, rel, cos)
    expected = next(p for p in ("bfloat16", "int8", "float32") if runs_here(precision_site, p))
    assert found["info"]["precision"] == expected, found["info"]
    scaled = json.loads((precision_site / "prec" / "_aoti" / "manifest.json").read_text())["models"]["scaled"]
    assert scaled["uses"] == ["bfloat16"] and "the others compute in bfloat16" in scaled["quantized"], scaled
    assert "prec/_aoti/scaled/" not in "".join(names), "no float32 variant: none was listed"
    # int8 where this CPU runs both it and bfloat16 natively, else bfloat16, else none
    problems = {v["precision"]: host.variant_problem(v, torch) for v in variants_of(scaled)}
    runs = [p for p in ("int8", "bfloat16") if problems[p] is None]
    assert found["scaled"]["precision"] == next(iter(runs), None), found["scaled"]
    if runs:  # called by keyword with a default left out
        assert found["scaled"]["rel"] < {"int8": 0.1, "bfloat16": 0.02}[runs[0]], found["scaled"]
    if problems["int8"] is not None:
        assert found["scaled"]["passed_over"]["int8"] == problems["int8"], found["scaled"]


QEMU = shutil.which("qemu-x86_64")


@pytest.mark.integration
@pytest.mark.skipif(QEMU is None or sys.platform != "linux", reason="qemu-user (apt qemu-user) is not installed")
def test_on_an_emulated_cpu_without_bfloat16_the_same_wheel_loads_another_variant(
    precision_site: Path, runtime: Runtime
) -> None:
    """``qemu-x86_64 -cpu Haswell``: AVX2, no AVX-512 and no bfloat16, whatever the host's /proc/cpuinfo says."""
    assert QEMU is not None
    found = in_site(runtime, precision_site, QEMU, "-cpu", "Haswell")
    assert found["info"]["precision"] == "float32", "no bfloat16, and no VNNI: int8's products would saturate"
    assert "needs a CPU with native bfloat16" in found["info"]["passed_over"]["bfloat16"]
    assert "needs a CPU with native int8" in found["info"]["passed_over"]["int8"]
    assert "needs a CPU with native bfloat16" in found["variants"]["bfloat16"], "asked for, it is refused"
    assert "needs a CPU with native int8" in found["variants"]["int8"], "asked for, it is refused"
    assert all(rel < 1e-4 for rel in found["default"])
    assert all(run[3] < 1e-4 for run in found["variants"]["float32"])
    assert found["scaled"]["precision"] is None, "none of its variants runs here: info() says why"
    assert "needs a CPU with native int8" in found["scaled"]["passed_over"]["int8"]
    assert "needs a CPU with native bfloat16" in found["scaled"]["passed_over"]["bfloat16"]


@pytest.mark.integration
def test_inspect_lists_the_variants_and_verify_checks_each_one_this_cpu_runs(
    precision_wheel: tuple[Path, str], precision_site: Path
) -> None:
    wheel = str(precision_wheel[0])
    shown = json.loads(run([sys.executable, "-m", "hatch_aoti", "inspect", wheel, "--json"]).stdout)
    net = shown["models"]["net"]
    assert [v["precision"] for v in net["variants"]] == ["bfloat16", "int8", "float32"]
    assert net["loads_here"] == next(p for p in ("bfloat16", "int8", "float32") if runs_here(precision_site, p))
    assert {f["path"].split("/")[1] for f in net["files"]} == {"net@bfloat16", "net@int8", "net"}
    assert net["variant_verification"]["int8"]["precision"] == "int8"
    proc = run([sys.executable, "-m", "hatch_aoti", "verify", wheel, "--eager", "--import-package", "--json"])
    result = json.loads(proc.stdout)["models"]["net"]
    assert result["status"] == "ok", result
    ran = {p for p in ("bfloat16", "int8", "float32") if runs_here(precision_site, p)}
    assert set(result["variants"]) == ran
    if runs_here(precision_site, "int8"):
        assert all(case["rel_error"] < 0.1 for case in result["variants"]["int8"]["cases"])
    quick = ["--repeats", "1", "--min-time", "0.001", "--warmup", "1", "--cold", "0", "--json"]
    env = {**os.environ, "HATCH_AOTI_PRECISION": "float32"}
    timed = json.loads(run([sys.executable, "-m", "hatch_aoti", "bench", wheel, "net", *quick], env=env).stdout)
    bench = timed["models"]["net"]
    assert bench["precision"] == "float32", "the variant HATCH_AOTI_PRECISION loads, not the CPU's choice"
    others = set(bench["per_call"][0]) & {"bfloat16", "int8", "float32"}
    assert others == ran - {"float32"}, bench["per_call"][0]


@pytest.mark.integration
def test_a_rebuild_with_another_list_of_precisions_takes_its_variants_from_the_cache(
    precision_wheel: tuple[Path, str], tmp_path: Path
) -> None:
    project = shutil.copytree(
        precision_wheel[0].parent.parent, tmp_path / "proj", ignore=shutil.ignore_patterns("dist")
    )
    pyproject = project / "pyproject.toml"
    listed = 'precision = ["bfloat16", "int8", "float32"]'
    pyproject.write_text(pyproject.read_text(encoding="utf-8").replace(listed, 'precision = ["int8", "float32"]'))
    log = build_no_isolation(project, project / "dist", env={**os.environ, "HATCH_AOTI_JOBS": "2"}).stderr
    assert "(4 variants: 4 from the cache)" in log, log
    (wheel,) = (project / "dist").glob("*.whl")
    assert not any("net@bfloat16" in n for n in zipfile.ZipFile(wheel).namelist())


@pytest.mark.integration
def test_an_int8_weight_the_library_lacks_is_a_clear_error_not_a_crash(
    precision_site: Path, runtime: Runtime, tmp_path: Path
) -> None:
    """oneDNN's int8 kernels read only packed weights: one whose packing names a weight the library does not
    have would run on nothing packed."""
    if not runs_here(precision_site, "int8"):
        pytest.skip("this CPU does not run the int8 variant")
    site = Path(shutil.copytree(precision_site, tmp_path / "site"))
    path = site / "prec" / "_aoti" / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    (int8,) = [v for v in manifest["models"]["net"]["variants"] if v["precision"] == "int8"]
    first = sorted(int8["packing"])[0]
    int8["packing"]["_no_such_weight"] = int8["packing"].pop(first)
    path.write_text(json.dumps(manifest), encoding="utf-8")
    code = f"import sys; sys.path.insert(0, {str(site)!r})\nfrom prec import compiled\n"
    code += "compiled.load('net', precision='int8')"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HATCH_AOTI_PRECISION")}
    proc = subprocess.run([str(runtime.python), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "its library has no weight _no_such_weight to pack, and runs only with it packed" in proc.stderr
