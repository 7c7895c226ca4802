"""Other frontends and layouts: `pip wheel`, `--no-isolation` with a src layout, editable installs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import Runtime, build_no_isolation, run, write_project

pytestmark = pytest.mark.integration

KWARGS_MODELS = """
    import torch
    from torch import nn

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x, *, scale, bias):
            y = self.lin(x) * scale
            return {"y": y + bias, "norm": y.norm(dim=-1)}

    class TokenScorer(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, tokens, *, mask):
            hidden = self.emb(tokens) * mask.unsqueeze(-1)
            return self.head(hidden.sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp_min(1))

    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x)

    def build():
        torch.manual_seed(0)
        return Scaled()

    def tokens():
        torch.manual_seed(2)
        return TokenScorer()

    def noisy():
        return Noisy()
"""

SAMPLED_MODELS = """
    import torch
    from torch import nn

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 6)
            self.out = nn.Linear(6, 3)

        def forward(self, tokens):
            return self.out(torch.tanh(self.emb(tokens))).mean(dim=1)

    def build():
        torch.manual_seed(1)
        return Tagger()

    def samples():
        gen = torch.Generator().manual_seed(0)
        return [(torch.randint(0, 50, (2, 7), generator=gen),), (torch.randint(0, 50, (6, 7), generator=gen),)]
"""


@pytest.fixture(scope="session")
def kwargs_wheel(tmp_path_factory: pytest.TempPathFactory, build_env: dict[str, str]) -> Path:
    root = tmp_path_factory.mktemp("kwargs") / "proj"
    write_project(
        root,
        "kwpkg",
        """
        [tool.hatch.build.targets.wheel.hooks.aoti.models.scaled]
        factory = "kwpkg.models:build"
        inputs = [{ shape = [2, 8] }]
        kwargs = { scale = { shape = [2, 1] }, bias = { shape = [4], dtype = "float32" } }

        [tool.hatch.build.targets.wheel.hooks.aoti.models.tokens]
        factory = "kwpkg.models:tokens"
        inputs = [{ shape = ["batch", "seq"], dtype = "int64", low = 0, high = 50 }]
        kwargs = { mask = { shape = ["batch", "seq"], dtype = "float32", low = 0, high = 1 } }
        dynamic = { batch = { min = 1, max = 8 }, seq = { min = 2, max = 40 } }

        [tool.hatch.build.targets.wheel.hooks.aoti.models.noisy]
        factory = "kwpkg.models:noisy"
        inputs = [{ shape = [16] }]
        verify = false
        """,
        {"models.py": KWARGS_MODELS},
    )
    out = root / "wheels"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(root)],
        env=build_env,
        cwd=root,
    )
    (wheel,) = out.glob("kwpkg-*.whl")
    return wheel


SRC_HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti]
    loader = "aot"

    [tool.hatch.build.targets.wheel.hooks.aoti.models.tagger]
    factory = "srcpkg.models:build"
    example-inputs = "srcpkg.models:samples"
    dynamic = { batch = { min = 1, max = 32 } }
"""


@pytest.fixture(scope="session")
def src_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("srclayout") / "proj"
    return write_project(root, "srcpkg", SRC_HOOK, {"models.py": SAMPLED_MODELS}, src=True)


@pytest.fixture(scope="session")
def src_wheel(src_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("srcwheel")
    build_no_isolation(src_project, out)
    (wheel,) = out.glob("srcpkg-*.whl")
    return wheel


def test_pip_wheel_kwargs_and_dict_outputs(kwargs_wheel: Path, runtime: Runtime) -> None:
    runtime.pip_install(str(kwargs_wheel))
    result = runtime.json(
        """
        import json, torch
        from kwpkg import compiled
        from kwpkg.models import build
        x, scale, bias = torch.randn(2, 8), torch.rand(2, 1), torch.randn(4)
        model = compiled.load("scaled")
        with torch.inference_mode():
            got = model(x, bias=bias, scale=scale)          # keyword order differs from the build
            ref = build()(x, scale=scale, bias=bias)
        try:
            model(x, scale=scale)
            missing = None
        except TypeError as exc:
            missing = str(exc)
        print(json.dumps({"keys": sorted(got), "err": max((got[k] - ref[k]).abs().max().item() for k in ref),
                          "missing": missing, "kwargs": compiled.info("scaled")["inputs"]["kwargs"]}))
        """
    )
    assert result["keys"] == ["norm", "y"] and result["err"] < 1e-5
    assert "'scaled'" in result["missing"] and "bias" in result["missing"]
    assert result["kwargs"] == {
        "scale": {"shape": [2, 1], "dtype": "float32"},
        "bias": {"shape": [4], "dtype": "float32"},
    }


def test_int64_tokens_with_dynamic_batch_and_sequence(kwargs_wheel: Path, runtime: Runtime) -> None:
    runtime.pip_install(str(kwargs_wheel))
    result = runtime.json(
        """
        import json, torch
        from kwpkg import compiled
        from kwpkg.models import tokens
        model, eager = compiled.load("tokens"), tokens()
        errs = {}
        with torch.inference_mode():
            for batch, seq in ((1, 2), (3, 17), (8, 40), (5, 9)):
                ids = torch.randint(0, 50, (batch, seq))
                mask = (torch.rand(batch, seq) > 0.3).float()
                errs[f"{batch}x{seq}"] = (model(ids, mask=mask) - eager(ids, mask=mask)).abs().max().item()
        try:
            model(torch.randint(0, 50, (2, 41)), mask=torch.ones(2, 41))
            too_long = None
        except ValueError as exc:
            too_long = str(exc)
        info = compiled.info("tokens")
        print(json.dumps({"errs": errs, "too_long": too_long, "dynamic": info["dynamic"],
                          "tried": [t["shapes"] for t in info["verification"]["tried"]]}))
        """
    )
    assert max(result["errs"].values()) < 1e-5, result["errs"]
    assert result["dynamic"] == {"batch": {"min": 1, "max": 8}, "seq": {"min": 2, "max": 40}}
    assert "seq in [2, 40]" in result["too_long"] and "'tokens'" in result["too_long"]
    assert result["tried"] == [[[2, 2], [2, 2]], [[1, 2], [1, 2]], [[4, 21], [4, 21]], [[8, 40], [8, 40]]]


def test_verify_false_builds_a_random_model(kwargs_wheel: Path, runtime: Runtime) -> None:
    runtime.pip_install(str(kwargs_wheel))
    result = runtime.json(
        """
        import json, torch
        from kwpkg import compiled
        y = compiled.load("noisy")(torch.zeros(16))
        print(json.dumps({"range": [y.min().item(), y.max().item()], "check": compiled.info("noisy")["verification"]}))
        """
    )
    assert 0.0 <= result["range"][0] <= result["range"][1] < 1.0
    assert result["check"] == {"passed": None, "skipped": "verify = false"}


def test_no_isolation_src_layout_with_inferred_dynamic_batch(src_wheel: Path, runtime: Runtime) -> None:
    runtime.pip_install(str(src_wheel))
    result = runtime.json(
        """
        import json, torch
        from srcpkg import aot
        from srcpkg.models import build
        model, eager = aot.load("tagger"), build()
        errs = {}
        with torch.inference_mode():
            for batch in (1, 4, 17, 32):          # sampled at 2 and 6; `dynamic` widened to 1..32
                tokens = torch.randint(0, 50, (batch, 7))
                errs[batch] = (model(tokens) - eager(tokens)).abs().max().item()
        print(json.dumps({"errs": errs, "dynamic": aot.info("tagger")["dynamic"]}))
        """
    )
    assert result["dynamic"] == {"batch": {"min": 1, "max": 32}}
    assert max(result["errs"].values()) < 1e-5


def test_editable_install_loads_compiled_models(src_project: Path, dev_venv: Path, build_env: dict[str, str]) -> None:
    """Without build isolation, as projects are developed: the venv's own hatchling, torch and hatch-aoti
    (from the wheelhouse). Isolated builds are the sample wheel's (``python -m build``)."""
    before = sorted(p.relative_to(src_project) for p in src_project.rglob("*") if "__pycache__" not in p.parts)
    python = dev_venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", "hatchling", "editables", "hatch-aoti"], env=build_env)
    run([str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "-e", str(src_project)], env=build_env)
    probe = run(
        [
            str(python),
            "-c",
            "import torch, srcpkg, srcpkg.aot as aot; from srcpkg.models import build;"
            "t = torch.randint(0, 50, (3, 7));"
            "print(srcpkg.__file__); print((aot.load('tagger')(t) - build()(t)).abs().max().item())",
        ],
        cwd=dev_venv,
    )
    package_file, err = probe.stdout.split()
    assert Path(package_file).resolve() == (src_project / "src" / "srcpkg" / "__init__.py").resolve()
    assert float(err) < 1e-5
    after = sorted(p.relative_to(src_project) for p in src_project.rglob("*") if "__pycache__" not in p.parts)
    assert after == before, "an editable install must not write into the source tree"
    # `hatch-aoti` finds the editable install's models by package and by loader name.
    site = next((dev_venv / "lib").glob("python3.*/site-packages"))
    cli = (
        f"import site, sys; site.addsitedir({str(site)!r}); from hatch_aoti.cli import main;"
        "sys.exit(main(['verify', sys.argv[1], '--json']))"
    )
    for name in ("srcpkg", "srcpkg.aot"):
        report = json.loads(run([sys.executable, "-c", cli, name], cwd=dev_venv).stdout)
        assert report["passed"] and report["models"]["tagger"]["status"] == "ok", report
