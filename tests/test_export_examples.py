"""scripts/export_examples.py: torch's export examples, raw AOTInductor against hatch-aoti."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "export_examples.py"
#: Cases that exercise what hatch-aoti adds over raw AOTInductor: a str input (``tensor_setattr``), an
#: ``int`` output over a dynamic dim, an input written into, keyword and variadic arguments, a nested
#: input, and ``torch.cond`` over a dynamic dim with the case's extra inputs.
SUBSET = ["tensor_setattr", "scalar_output", "user_input_mutation", "fn_with_kwargs", "pytree_flatten", "cond_operands"]


@functools.cache
def script() -> ModuleType:
    """The script, imported as a module (its dataclass needs it in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location("export_examples", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_failed_models_names_each_model_and_why() -> None:
    found = script().failed_models(
        "ERROR Backend subprocess exited when trying to invoke build_wheel\n"
        "hatch-aoti: 2 models failed; 3 models were built and cached:\n"
        "  - model 'boom' (tool.hatch.build.targets.wheel.hooks.aoti.models.boom) failed at compile: "
        "the aoti backend failed: InductorError: CppCompileError: C++ compile error\n"
        "  - model 'off' (tool.hatch.build.targets.wheel.hooks.aoti.models.off) failed at verify: output differs\n",
        ["boom", "off", "fine"],
    )
    assert found == {
        "boom": "failed at compile: the aoti backend failed: InductorError: CppCompileError: C++ compile error",
        "off": "failed at verify: output differs",
    }


def test_failed_models_from_a_crash_or_refused_settings() -> None:
    module = script()
    crash = (
        "hatch-aoti: internal error of hatch-aoti while exporting model 'odd': AttributeError: 'str' object "
        "has no attribute 'dtype'; the traceback is in its log, /tmp/x"
    )
    assert module.failed_models(crash, ["odd", "fine"]) == {
        "odd": "internal error of hatch-aoti while exporting model 'odd': AttributeError: 'str' object has no "
        "attribute 'dtype'"
    }
    refused = (
        "hatch-aoti found 1 problem in pyproject.toml:\n"
        "  - tool.hatch.build.targets.wheel.hooks.aoti.models.bad.example-inputs: returned an empty list of samples\n"
    )
    assert module.failed_models(refused, ["bad", "fine"]) == {"bad": "refused: returned an empty list of samples"}
    assert module.failed_models("Killed", ["a", "b"]) == {
        "a": "the build failed and named no model",
        "b": "the build failed and named no model",
    }


def test_compare_checks_types_values_and_structure() -> None:
    torch = pytest.importorskip("torch")
    compare = script().compare
    compare({"y": [torch.ones(2), 3]}, {"y": [torch.ones(2), 3]}, "output")
    with pytest.raises(AssertionError, match=r"output is Tensor, eager gives int"):
        compare(3, torch.tensor(3), "output")
    compare(3, torch.tensor(3), "output", types=False)  # raw AOTInductor's 0-d tensor for an int
    with pytest.raises(AssertionError, match=r"output\['y'\]\[0\]"):
        compare({"y": [torch.ones(2)]}, {"y": [torch.zeros(2)]}, "output")
    with pytest.raises(AssertionError, match="has keys"):
        compare({"y": 1}, {"z": 1}, "output")


def test_samples_grow_each_dynamic_dim_and_add_the_extra_inputs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    module = script()
    module.write_project(tmp_path / "project", [], ["cond_operands", "scalar_output", "dictionary"], "2.13")
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path / 'project')!r}); from export_cases import cases\n"
        "for name in ('cond_operands', 'scalar_output', 'dictionary'):\n"
        "    print(name, [tuple(args[0].shape) for args, kwargs in cases.samples(name)])\n"
        "print(float(cases.examples()['optional_input'].model.forward.__defaults__[0].sum()))\n"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in range(2)]
    lines = runs[0].stdout.splitlines()
    assert lines[:3] == [
        "cond_operands [(3, 2), (4, 2), (2, 2)]",  # grown by one, then the case's extra inputs
        "scalar_output [(3, 2), (3, 3)]",
        "dictionary [(3, 2)]",
    ]
    assert runs[1].stdout == runs[0].stdout, "the examples' random values are the same in every process"


@pytest.mark.integration
@pytest.mark.heavy
def test_export_examples_build_with_hatch_aoti(tmp_path: Path) -> None:
    """A subset of the cases, through the script: raw AOTInductor, then a wheel built with hatch-aoti,
    installed into a fresh venv with torch, each model against eager."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cases", ",".join(SUBSET), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    hatch = {
        words[0]: words[-1] for words in map(str.split, proc.stdout.splitlines()) if words[:1] in [[n] for n in SUBSET]
    }
    assert hatch == dict.fromkeys(SUBSET, "ok"), proc.stdout
