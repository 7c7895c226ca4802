"""The cache key covers everything that changes the compiled code, and nothing about the project (no compiling)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from hatch_aoti.settings.resolve import parse_settings
from hatch_aoti.worker.fingerprint import cache_key
from hatch_aoti.worker.inputs import plan_declared


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    exported = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(2, 3),))
    (spec,) = parse_settings(
        {"models": {"m": {"factory": "a:b", "inputs": [{"shape": [2, 3]}]}}}, machine="x86_64", flags=set()
    ).models
    return exported, spec, plan_declared(spec, ["input"])


def test_the_key_follows_inductor_settings_and_environment(program, monkeypatch: pytest.MonkeyPatch) -> None:
    exported, spec, plan = program
    base = cache_key(exported, spec, plan, {})
    assert cache_key(exported, spec, plan, {}) == base
    assert cache_key(exported, spec, plan, {"max_autotune": True}) != base, "the model's own settings"
    with torch._inductor.config.patch({"max_autotune": True}):
        assert cache_key(exported, spec, plan, {}) != base, "the global Inductor config"
    monkeypatch.setenv("TORCHINDUCTOR_DEBUG_COMPILE", "1")  # read by the C++ builder, not the config
    assert cache_key(exported, spec, plan, {}) != base, "a TORCHINDUCTOR_* variable"
    monkeypatch.delenv("TORCHINDUCTOR_DEBUG_COMPILE")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    assert cache_key(exported, spec, plan, {}) == base, "where Inductor keeps its cache changes no code"


def test_the_key_ignores_the_name_and_follows_checks_and_target(program) -> None:
    exported, spec, plan = program
    base = cache_key(exported, spec, plan, {})
    renamed = dataclasses.replace(spec, name="other", factory="elsewhere:build", path="tool.x.models.other")
    assert cache_key(exported, renamed, plan, {}) == base, "the same model in two projects shares an entry"
    for change in ({"rtol": 0.1}, {"verify": False}, {"cpu_target": "x86-64-v4"}, {"cpu_target": "native"}):
        assert cache_key(exported, dataclasses.replace(spec, **change), plan, {}) != base, change


def test_the_key_of_a_cuda_model_follows_the_gpu(program, monkeypatch: pytest.MonkeyPatch) -> None:
    exported, spec, plan = program
    cuda = dataclasses.replace(spec, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ampere = cache_key(exported, cuda, plan, {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cache_key(exported, cuda, plan, {}) != ampere


def test_the_key_follows_weights_code_and_inputs(program) -> None:
    exported, spec, plan = program
    base = cache_key(exported, spec, plan, {})
    torch.manual_seed(1)
    weights = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(2, 3),))
    torch.manual_seed(0)
    code = torch.export.export(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()), (torch.randn(2, 3),))
    torch.manual_seed(0)
    shape = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(5, 3),))
    keys = {cache_key(p, spec, plan, {}) for p in (weights, code, shape)}
    assert base not in keys and len(keys) == 3
    torch.manual_seed(0)
    again = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(2, 3),))
    assert cache_key(again, spec, plan, {}) == base, "the same model exported again hits"


def test_a_variants_key_follows_its_precision_and_check_but_not_the_other_variants(program) -> None:
    exported, spec, plan = program
    base = cache_key(exported, spec, plan, {})
    listed = dataclasses.replace(spec, precision=("float32",), accuracy={"int8": {"rel_error": 0.5}})
    assert cache_key(exported, listed, plan, {}) == base, "a float32 variant keys as a float32 model always did"
    bf16 = dataclasses.replace(spec, precision=("bfloat16",))
    assert cache_key(exported, bf16, plan, {}) != base
    other_check = dataclasses.replace(bf16, accuracy={"int8": {"rel_error": 0.5}})
    assert cache_key(exported, other_check, plan, {}) == cache_key(exported, bf16, plan, {}), "int8's check"
    tighter = dataclasses.replace(bf16, accuracy={"bfloat16": {"rel_error": 0.001}})
    assert cache_key(exported, tighter, plan, {}) != cache_key(exported, bf16, plan, {}), "its own check"
