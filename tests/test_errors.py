"""Bad input fails the build with a clear message, every TOML path named, and no wheel written."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TABLES, build_no_isolation, write_project

pytestmark = pytest.mark.integration

M = f"{TABLES['hatch']}.models"

MODELS = """
    import torch
    from torch import nn

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, a, b):
            return self.lin(a) + b

    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:          # data-dependent control flow: not exportable
                return x * 2
            return x - 1

    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x)   # random by design: compiled != eager

    def two():
        return Two()

    def branchy():
        return Branchy()

    def noisy():
        return Noisy()

    def not_a_module():
        return 42

    def crash():
        import os, signal
        print("about to crash")
        os.kill(os.getpid(), signal.SIGSEGV)   # a native crash, as a broken extension would

    boom = 3

    def nested_samples():
        x = torch.randn(2, 4)
        return [((x,),), ((x[:1],),)]   # one tuple too many: forward(a, b) gets a tuple as `a`

    def single():
        return Single()

    class Single(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)
"""


@pytest.fixture(params=["hatch", "setuptools"])
def frontend(request: pytest.FixtureRequest) -> str:
    """Configuration errors read the same through both front ends, each naming its own table."""
    return request.param


def failing_build(tmp_path: Path, hook_toml: str, frontend: str = "hatch", torch: str = "torch==2.13.*") -> str:
    """Build a project that must fail; the output, with the hatch table's path whatever the front end."""
    project = write_project(
        tmp_path / "proj", "badpkg", hook_toml, {"models.py": MODELS}, frontend=frontend, torch=torch
    )
    out = tmp_path / "out"
    proc = build_no_isolation(project, out, check=False)
    assert proc.returncode != 0, proc.stdout
    assert not out.exists() or not list(out.iterdir()), "a failed build must not leave a wheel behind"
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text
    if frontend != "hatch":
        assert TABLES["hatch"] not in text, "messages name the table the user wrote"
    return text.replace(TABLES[frontend], TABLES["hatch"])


def test_bad_toml_fails_before_compiling_with_all_paths(tmp_path: Path, frontend: str) -> None:
    text = failing_build(
        tmp_path,
        """
        [tool.hatch.build.targets.wheel.hooks.aoti]
        loder = "x"

        [tool.hatch.build.targets.wheel.hooks.aoti.models.a]
        factroy = "badpkg.models:two"
        inputs = [{ shape = [2, 4], dtype = "float33" }]

        [tool.hatch.build.targets.wheel.hooks.aoti.models.b]
        factory = "badpkg.models:two"
        inputs = [{ shape = ["n", 4] }]
        dynamic = { n = { min = 8, max = 2 }, m = { max = 3 } }
        """,
        frontend,
    )
    assert "hatch-aoti found 6 problems" in text
    for fragment in (
        "tool.hatch.build.targets.wheel.hooks.aoti.loder: unknown key (did you mean `loader`?)",
        f"{M}.a.factroy: unknown key (did you mean `factory`?)",
        f"{M}.a.factory: is required",
        f"{M}.a.inputs[0].dtype: unknown dtype 'float33'",
        f"{M}.b.dynamic.n: min (8) is greater than max (2)",
        f"{M}.b.dynamic.m: is not used by any input shape",
    ):
        assert fragment in text
    assert "compiling" not in text


def test_factories_and_signatures_are_checked_together(tmp_path: Path, frontend: str) -> None:
    text = failing_build(
        tmp_path,
        """
        [tool.hatch.build.targets.wheel.hooks.aoti.models.missing]
        factory = "badpkg.nowhere:build"
        inputs = [{ shape = [2, 4] }]

        [tool.hatch.build.targets.wheel.hooks.aoti.models.number]
        factory = "badpkg.models:not_a_module"
        inputs = [{ shape = [2, 4] }]

        [tool.hatch.build.targets.wheel.hooks.aoti.models.notcallable]
        factory = "badpkg.models:boom"
        inputs = [{ shape = [2, 4] }]

        [tool.hatch.build.targets.wheel.hooks.aoti.models.arity]
        factory = "badpkg.models:two"
        inputs = [{ shape = [2, 4] }]
        """,
        frontend,
    )
    assert "hatch-aoti found 4 problems" in text
    assert f"{M}.missing.factory: cannot import 'badpkg.nowhere:build': ModuleNotFoundError" in text
    assert f"{M}.number.factory: 'badpkg.models:not_a_module' returned int, not a torch.nn.Module" in text
    assert f"{M}.notcallable.factory: 'badpkg.models:boom' is a int, not a callable" in text
    assert f"{M}.arity.inputs: do not match Two.forward(a, b)" in text


def test_samples_that_cannot_match_forward_are_named_before_export(tmp_path: Path, frontend: str) -> None:
    text = failing_build(
        tmp_path,
        """
        [tool.hatch.build.targets.wheel.hooks.aoti.models.nested]
        factory = "badpkg.models:single"
        example-inputs = "badpkg.models:nested_samples"

        [tool.hatch.build.targets.wheel.hooks.aoti.models.narrowed]
        factory = "badpkg.models:single"
        example-inputs = "badpkg.models:nested_samples"
        dynamic = { batch = { max = 1 } }
        """,
        frontend,
    )
    assert "hatch-aoti found 2 problems" in text
    message = text.split(f"{M}.nested.example-inputs: ", 1)[1].split("\n  - ", 1)[0]
    assert message.startswith(
        "Single.forward failed on sample 0, called with x=a tuple (a float32 tensor of shape [2, 4])"
    )
    assert "TypeError: linear(): argument 'input'" in message and "return (x,), not ((x,),)" in message
    assert f"{M}.narrowed.dynamic.batch.max: is 1, below the largest size of 'batch' in the samples (2)" in text


def test_export_failure_names_the_model_and_keeps_torch_reason(tmp_path: Path) -> None:
    text = failing_build(
        tmp_path,
        """
        [tool.hatch.build.targets.wheel.hooks.aoti.models.branchy]
        factory = "badpkg.models:branchy"
        inputs = [{ shape = [3] }]
        """,
    )
    assert f"model 'branchy' ({M}.branchy) failed at export: torch.export failed:" in text
    assert "data-dependent" in text.lower() or "guard" in text.lower()


def test_a_crash_is_a_build_error_naming_the_model_with_the_log(tmp_path: Path, frontend: str) -> None:
    text = failing_build(
        tmp_path,
        """
        [tool.hatch.build.targets.wheel.hooks.aoti.models.boom]
        factory = "badpkg.models:crash"
        inputs = [{ shape = [2] }]
        """,
        frontend,
    )
    assert "the build coordinator was killed by signal 11 while checking model 'boom'" in text
    assert "| about to crash" in text


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('package = "badpkg.models"', "package: 'badpkg.models' is not a package in this wheel (found: badpkg)"),
        ('loader = "models"', "loader: badpkg/models.py already exists in the project; choose another `loader`"),
    ],
)
def test_where_the_loader_goes_is_checked_the_same_by_both_front_ends(
    tmp_path: Path, frontend: str, table: str, expected: str
) -> None:
    text = failing_build(
        tmp_path,
        f"""
        [tool.hatch.build.targets.wheel.hooks.aoti]
        {table}

        [tool.hatch.build.targets.wheel.hooks.aoti.models.single]
        factory = "badpkg.models:single"
        inputs = [{{ shape = [2, 4] }}]
        """,
        frontend,
    )
    assert f"{TABLES['hatch']}.{expected}" in text


def test_a_precompile_factory_that_gives_other_weights_each_call_is_named_at_verify(tmp_path: Path) -> None:
    text = failing_build(
        tmp_path,
        """
        [tool.hatch.build.targets.wheel.hooks.aoti.models.single]
        backend = "precompile"
        factory = "badpkg.models:single"
        inputs = [{ shape = [2, 4] }]
        """,
        torch="torch==2.13.0",  # precompiled models load only under the torch that built them
    )
    assert f"model 'single' ({M}.single) failed at verify: compiled model differs from eager" in text
    assert "two calls of `factory` gave other weights (`lin.weight` differs)" in text
