"""Compiled models behave as the eager ones do, on every call structure: output types, inputs they
write into, dims that follow other dims, precompiled models over their whole range, CPU checks.

One wheel (built once, with real frontends and compilers) holds a model of each kind; it is
installed into the runtime venv, which has torch but not hatch-aoti.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
from conftest import Runtime, build_no_isolation, run, write_project

MODELS = """
    import torch
    from torch import nn


    class Numbers(nn.Module):
        def forward(self, x):
            return x.sin(), x.shape[1] + 1, x.shape[0] * 2


    class Mutates(nn.Module):
        def forward(self, x, y):
            x.mul_(2)
            return x.cos() + y


    class KeywordOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x, *, scale, **extra):
            return {"y": self.lin(x) * scale, "z": extra["bias"] + 1}


    class Nested(nn.Module):
        def forward(self, xs, parts):
            return {"sum": xs[0] + xs[1], "prod": (parts["a"] * parts["b"], parts["a"].shape[0])}


    class Views(nn.Module):
        def forward(self, x):
            return x.t(), x[1:, ::2], x * 2, x.reshape(-1)[:3]


    class Frames(nn.Module):
        def forward(self, x):
            return x.view(x.shape[0], -1, 320).sum(-1)


    def numbers():
        return Numbers()


    def mutates():
        return Mutates()


    def keyword_only():
        torch.manual_seed(0)
        return KeywordOnly()


    def nested():
        return Nested()


    def views():
        return Views()


    def frames():
        return Frames()


    def convnet():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


    def frame_samples():
        return [(torch.randn(2, 3200),), (torch.randn(2, 6400),)]


    def keyword_samples():
        return ((torch.randn(2, 8),), {"scale": torch.randn(2, 1), "bias": torch.randn(3)})


    def nested_samples():
        return (([torch.randn(3, 4), torch.randn(3, 4)], {"a": torch.randn(5), "b": torch.randn(5)}), {})
"""
HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti.models.numbers]
    factory = "fidpkg.models:numbers"
    inputs = [{ shape = ["batch", 3] }]
    dynamic = { batch = { min = 1, max = 16 } }

    [tool.hatch.build.targets.wheel.hooks.aoti.models.mutates]
    factory = "fidpkg.models:mutates"
    inputs = [{ shape = [4, 3] }, { shape = [4, 3] }]

    [tool.hatch.build.targets.wheel.hooks.aoti.models.views]
    factory = "fidpkg.models:views"
    inputs = [{ shape = [6, 4] }]

    [tool.hatch.build.targets.wheel.hooks.aoti.models.keyword_only]
    factory = "fidpkg.models:keyword_only"
    example-inputs = "fidpkg.models:keyword_samples"

    [tool.hatch.build.targets.wheel.hooks.aoti.models.nested]
    factory = "fidpkg.models:nested"
    example-inputs = "fidpkg.models:nested_samples"

    [tool.hatch.build.targets.wheel.hooks.aoti.models.frames]
    factory = "fidpkg.models:frames"
    example-inputs = "fidpkg.models:frame_samples"

    [tool.hatch.build.targets.wheel.hooks.aoti.models.framed]
    factory = "fidpkg.models:frames"
    inputs = [{ shape = [2, "samples"] }]
    dynamic = { samples = "320*frames", frames = { min = 10, max = 20 } }

    [tool.hatch.build.targets.wheel.hooks.aoti.models.conv]
    backend = "precompile"
    factory = "fidpkg.models:convnet"
    inputs = [{ shape = ["batch", 3, 16, 16] }]
    dynamic = { batch = { min = 1, max = 64 } }
"""


@pytest.fixture(scope="session")
def fidelity_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = write_project(
        tmp_path_factory.mktemp("fidelity") / "proj", "fidpkg", HOOK, {"models.py": MODELS}, torch="torch==2.13.0"
    )  # the precompiled model's exact pin, stated by the project
    proc = build_no_isolation(root, root / "dist", env={**os.environ, "HATCH_AOTI_JOBS": "2"})
    (wheel,) = (root / "dist").glob("*.whl")
    return wheel, proc.stderr


@pytest.fixture(scope="session")
def fidelity(fidelity_wheel: tuple[Path, str], runtime: Runtime) -> Runtime:
    runtime.pip_install(str(fidelity_wheel[0]))
    return runtime


def in_runtime(runtime: Runtime, code: str) -> Any:
    """Run ``code`` after the imports every check needs; it prints one JSON document last."""
    prelude = "import json, torch\nfrom torch.testing import assert_close\nfrom fidpkg import compiled, models\n"
    return runtime.json(prelude + textwrap.dedent(code))


# -- 1. Python numbers ---------------------------------------------------------------------------


@pytest.mark.integration
def test_python_numbers_come_back_as_the_eager_model_returns_them(fidelity: Runtime) -> None:
    result = in_runtime(
        fidelity,
        """
        model, eager = compiled.load("numbers"), models.numbers()
        x = torch.randn(5, 3)
        got, want = model(x), eager(x)
        assert_close(got[0], want[0])
        print(json.dumps({"got": [type(v).__name__ for v in got], "want": [type(v).__name__ for v in want],
                          "values": list(got[1:]), "eager": list(want[1:])}))
    """,
    )
    assert result["got"] == result["want"] == ["Tensor", "int", "int"]
    assert result["values"] == result["eager"] == [4, 10]


def test_verification_compares_types_and_names_the_output() -> None:
    import torch

    from hatch_aoti.worker.verify import compare

    x = torch.ones(2)
    found = compare("example", {"logits": x, "n": 3}, {"logits": x, "n": torch.tensor(3)}, None, None)
    assert found.problems == ["output['n']: eager 3 (int), compiled tensor(3) (Tensor)"]
    assert compare("example", (x, 3), (x, 3), None, None).problems == []
    assert "output[1]: eager 3 (int), compiled 3.0 (float)" in compare("e", (x, 3), (x, 3.0), None, None).problems


# -- 2. Inputs the model writes into ---------------------------------------------------------------


@pytest.mark.integration
def test_inputs_are_written_as_eager_writes_them(fidelity: Runtime, fidelity_wheel: tuple[Path, str]) -> None:
    result = in_runtime(
        fidelity,
        """
        model, eager = compiled.load("mutates"), models.mutates()
        out = {}
        for layout in ("contiguous", "transposed", "inference"):
            with torch.inference_mode(layout == "inference"):
                x, y = torch.rand(4, 3), torch.rand(4, 3)
                if layout == "transposed":
                    x = x.t().contiguous().t()
                ex, ey = x.clone(), y.clone()
                got, want = model(x, y), eager(ex, ey)
                assert_close(got, want)
                assert_close(x, ex)  # the caller's own tensor, doubled
                assert_close(y, ey)
                out[layout] = x.is_contiguous()
        mutated = [leaf.get("mutated", False) for leaf in compiled.info("mutates")["call"]]
        print(json.dumps({"layouts": out, "mutated": mutated}))
    """,
    )
    assert result == {"layouts": {"contiguous": True, "transposed": False, "inference": True}, "mutated": [True, False]}
    assert "mutates: compiled in" in fidelity_wheel[1], "a model that writes its input builds and verifies"


@pytest.mark.integration
def test_inputs_are_checked_as_eager_would_and_bound_to_forward(fidelity: Runtime) -> None:
    """Inputs passed by name reach the model; an input the model writes into may not share memory with
    another (the compiled code would not see the write); nothing of the manifest's signature is lost."""
    result = in_runtime(
        fidelity,
        """
        model, eager = compiled.load("mutates"), models.mutates()
        x, y = torch.rand(4, 3), torch.rand(4, 3)
        ex, ey = x.clone(), y.clone()
        assert_close(model(y=y, x=x), eager(ex, ey))
        assert_close(x, ex)
        both = torch.rand(4, 3)
        try:
            model(both, both)
            shared = None
        except ValueError as exc:
            shared = str(exc)
        signature = compiled.info("mutates")["signature"]
        print(json.dumps({"shared": shared, "signature": signature}))
    """,
    )
    assert result["signature"] == [
        {"name": "x", "kind": "POSITIONAL_OR_KEYWORD"},
        {"name": "y", "kind": "POSITIONAL_OR_KEYWORD"},
    ]
    assert "input 0, which the model writes into, shares memory with input 1" in result["shared"]


def test_verification_compares_the_inputs_after_the_call() -> None:
    import torch

    from hatch_aoti.worker.verify import VerificationFailed, verify_model

    def eager(x: Any) -> Any:
        x.mul_(2)
        return x.cos()

    def forgets(x: Any) -> Any:  # the right output, but the input left as it was
        return (x * 2).cos()

    sample = [("example", ((torch.ones(3),), {}))]
    report, _ = verify_model(eager, sample, eager, None, None)
    assert report["passed"] and torch.equal(sample[0][1][0][0], torch.ones(3)), "each run writes its own copy"
    with pytest.raises(VerificationFailed, match=r"after the call, input\[0\]\[0\]: values differ"):
        verify_model(eager, sample, forgets, None, None)


def seeded() -> Any:
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))


def unseeded() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))


def test_a_factory_that_gives_other_weights_each_call_is_named_as_the_cause() -> None:
    from types import SimpleNamespace

    from hatch_aoti.worker.verify import rebuilt_unlike

    def spec(factory: str) -> Any:
        return SimpleNamespace(factory=f"{__name__}:{factory}", path="models.m", device="cpu")

    assert rebuilt_unlike(spec("seeded"), "precompile") is None
    why = rebuilt_unlike(spec("unseeded"), "precompile")
    assert why is not None and why.startswith("two calls of `factory` gave other weights (`0.weight` differs)")
    assert rebuilt_unlike(spec("missing"), "precompile") is None, "no cause found, none told"


# -- 3. Every call structure -------------------------------------------------------------------------


@pytest.mark.integration
def test_keyword_nested_and_dict_calls_match_eager(fidelity: Runtime) -> None:
    result = in_runtime(
        fidelity,
        """
        kw, nested = compiled.load("keyword_only"), compiled.load("nested")
        x, s, b = torch.randn(2, 8), torch.randn(2, 1), torch.randn(3)
        assert_close(kw(x, scale=s, bias=b), models.keyword_only()(x, scale=s, bias=b))
        xs = [torch.randn(3, 4), torch.randn(3, 4).t().contiguous().t()]
        parts = {"b": torch.randn(5), "a": torch.randn(5)}
        got, want = nested(xs, parts), models.nested()(xs, parts)
        assert_close(got, want)
        errors = []
        for call in (lambda: kw(x, scale=s), lambda: kw(x, s, bias=b), lambda: nested(tuple(xs), parts),
                     lambda: nested(xs, {"a": parts["a"]}), lambda: nested([xs[0], xs[1][:2]], parts)):
            try:
                call()
                errors.append(None)
            except (TypeError, ValueError) as exc:
                errors.append(type(exc).__name__)
        print(json.dumps({"types": [type(got["prod"]).__name__, type(got["prod"][1]).__name__], "errors": errors}))
    """,
    )
    assert result["types"] == ["tuple", "int"]
    assert result["errors"] == ["TypeError", "TypeError", "TypeError", "TypeError", "ValueError"]


def fake_model(
    loader: Any,
    inputs: Any,
    outputs: Any,
    run: Any,
    signature: list[dict[str, Any]] | None = None,
    views: list[tuple[int, int]] | None = None,
    **leaf: Any,
) -> Any:
    """The loader's call function for a model of these input and output structures (example values), whose
    runner is ``run``: the generated code without a compiled library."""
    import types

    import torch
    from torch.utils import _pytree as pytree

    in_leaves, in_spec = pytree.tree_flatten((inputs, {}))
    out_leaves, out_spec = pytree.tree_flatten(outputs)
    engine = types.SimpleNamespace(
        name="fake",
        device="cpu",
        file="",
        runner=None,
        weights=None,
        run=run,
        pytree=pytree,
        tensor=torch.Tensor,
        strided=torch.strided,
        in_spec=in_spec,
        out_spec=out_spec,
        n_args=len(inputs),
        kwarg_names=(),
        constants=[],
        tensor_index=list(range(len(in_leaves))),
        complex=False,
        leaves=[{"dtype": "float32", "device": "cpu", "shape": list(t.shape), **leaf} for t in in_leaves],
        outputs=[{"kind": "int"} if isinstance(v, int) else {"kind": "tensor"} for v in out_leaves],
        views=views or [],
        aminmax=torch.aminmax,
        signature=signature or [],
    )
    engine.checks = [loader.inputs.tensor_check(torch, leaf) for leaf in engine.leaves]
    engine.index_rows = [(i, leaf["index_rows"]) for i, leaf in enumerate(engine.leaves) if "index_rows" in leaf]
    engine.mutated = [i for i, leaf in enumerate(engine.leaves) if leaf.get("mutated")]
    engine.unsafe = loader.inputs.unsafe_writes(torch, engine.mutated) if engine.mutated else None
    for method in ("flatten", "reject", "check_indices", "check_writes"):
        setattr(engine, method, types.MethodType(getattr(loader.engine.Model, method), engine))
    return loader.calls.aoti_call(engine)


def test_generated_calls_take_any_container_of_tensors(tmp_path: Path) -> None:
    import torch

    loader = loader_module(tmp_path)
    x = torch.ones(2)
    model = fake_model(
        loader, ({1: x, "k": [x, (x,)]},), (x, (), {2: [x]}, 3), lambda flat: [flat[0], flat[1], 3 + 0 * x.sum()]
    )
    got = model({"k": [x, (x,)], 1: x * 2})  # keys in another order, one of them not a string
    assert got[1:] == ((), {2: [x]}, 3) and type(got[3]) is int and torch.equal(got[0], x * 2)
    with pytest.raises(TypeError, match="do not have the structure it was built with"):
        model({1: x, "k": [x, [x]]})  # a list where the model takes a tuple
    with pytest.raises(TypeError, match="must be a tensor"):
        model({1: x, "k": [x, (3,)]})


def test_a_call_forward_takes_is_laid_out_as_the_model_was_exported(tmp_path: Path) -> None:
    """Arguments by name and defaults left out, as eager takes them; an argument the export left at its
    default takes only that default."""
    import torch

    loader = loader_module(tmp_path)
    a, b = torch.ones(2), torch.full((2,), 3.0)
    pair = [{"name": "x", "kind": "POSITIONAL_OR_KEYWORD"}, {"name": "y", "kind": "POSITIONAL_OR_KEYWORD"}]
    model = fake_model(loader, (a, b), a, lambda flat: [flat[0] - flat[1]], signature=pair)
    for args, kwargs in (((a, b), {}), ((a,), {"y": b}), ((), {"y": b, "x": a})):
        assert torch.equal(model(*args, **kwargs), a - b)
    with pytest.raises(TypeError, match=r"takes 2 positional input\(s\) .*got 1 positional and \['z'\]"):
        model(a, z=b)
    optional = [*pair[:1], {"name": "mask", "kind": "POSITIONAL_OR_KEYWORD", "default": None}]
    model = fake_model(loader, (a,), a, lambda flat: [flat[0] * 2], signature=optional)  # exported without a mask
    assert torch.equal(model(a, None), a * 2) and torch.equal(model(x=a, mask=None), a * 2)
    with pytest.raises(TypeError, match=r"got 1 positional and \['mask'\] \(unexpected: \['mask'\]\)"):
        model(a, mask=b)  # the compiled model has no mask


def test_an_index_outside_its_table_is_an_index_error_as_in_eager(tmp_path: Path) -> None:
    """The compiled kernel's own bounds check would end the process (it throws inside a parallel region)."""
    import torch

    loader = loader_module(tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    model = fake_model(loader, (ids,), ids, lambda flat: [flat[0] * 2], dtype="int64", index_rows=10)
    assert torch.equal(model(ids), ids * 2)
    assert torch.equal(model(torch.tensor([[0, 9, 9]])), torch.tensor([[0, 18, 18]]))
    for bad, value in ((10, 10), (-1, -1), (40000, 40000)):
        with pytest.raises(IndexError, match=rf"input 0 indexes a table of 10 rows, .* \[0, 10\); got {value}$"):
            model(torch.tensor([[1, bad, 3]]))


def test_inputs_the_model_writes_into_are_refused_where_eager_would_differ(tmp_path: Path) -> None:
    """The compiled code reads every input as it was before the call: an input sharing memory with one the
    model writes into would not see the write, as it does in eager. Eager's own refusals hold too."""
    import torch

    loader = loader_module(tmp_path)
    x = torch.arange(8.0)

    def written(flat: list[Any]) -> list[Any]:
        flat[0].mul_(2)
        return [flat[0] + flat[1]]

    model = fake_model(loader, (x[:4], x[4:]), x[:4], written, mutated=True)
    a, b = x[:4].clone(), x[4:].clone()
    assert torch.equal(model(a, b), torch.tensor([4.0, 7, 10, 13])) and torch.equal(a, torch.tensor([0.0, 2, 4, 6]))
    model(x[:4], x[4:])  # one storage, apart: nothing overlaps
    model(x[0::2], x[1::2])  # interleaved, no byte in common
    state = torch.zeros(4, 2)
    model(state[:, 0], state[:, 1])  # two columns of one matrix
    assert torch.equal(state[:, 0], torch.zeros(4))
    for first, second in ((x[:4], x[2:6]), (x[4:], x[4:]), (x[::2], x[1:5])):
        with pytest.raises(ValueError, match="input 0, which the model writes into, shares memory with input 1;"):
            model(first, second)
    with pytest.raises(RuntimeError, match="input 0, which the model writes into, is a leaf tensor that requires grad"):
        model(torch.zeros(4, requires_grad=True), torch.zeros(4))
    with torch.no_grad():
        model(torch.zeros(4, requires_grad=True), torch.zeros(4))  # as eager: no graph, no refusal
    with torch.inference_mode():
        made = torch.zeros(4)
    with pytest.raises(RuntimeError, match="input 0, which the model writes into, is an inference tensor"):
        model(made, torch.zeros(4))


def test_an_output_that_is_an_input_is_the_callers_tensor(tmp_path: Path) -> None:
    """Also where the loader ran the model on a contiguous copy of it, written back or not."""
    import torch

    loader = loader_module(tmp_path)
    shape = torch.zeros(2, 4)
    for mutated in (False, True):
        model = fake_model(loader, (shape,), (shape, shape), lambda flat: [flat[0], flat[0] + 1], mutated=mutated)
        strided, plain = torch.randn(4, 2).t(), torch.randn(2, 4)
        for x in (strided, plain):
            same, other = model(x)
            assert same is x and torch.equal(other, x + 1)


@pytest.mark.integration
@pytest.mark.integration
def test_views_of_an_input_are_views_of_the_callers_tensor(fidelity: Runtime) -> None:
    """As in eager, also where the loader ran the model on a contiguous copy of a strided input; and an
    output eager makes from a copy of it (``reshape`` of a transposed tensor) shares nothing with it."""
    result = in_runtime(
        fidelity,
        """
        model, eager = compiled.load("views"), models.views()
        out = {}
        for layout, x in (("contiguous", torch.randn(6, 4)), ("strided", torch.randn(4, 6).t())):
            got, want = model(x), eager(x)
            assert_close(got, want)
            shares = [[o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for o in outs]
                      for outs in (got, want)]
            out[layout] = [[[s, o.stride() if s else None] for s, o in zip(*pair)] for pair in zip(shares, (got, want))]
        print(json.dumps(out))
    """,
    )
    assert result["contiguous"][0] == result["contiguous"][1]
    assert result["strided"][0] == result["strided"][1]
    assert result["strided"][0] == [[True, [6, 1]], [True, [1, 12]], [False, None], [False, None]]


def test_a_view_of_an_input_is_a_view_of_the_callers_tensor(tmp_path: Path) -> None:
    """The runner's view of the loader's contiguous copy becomes the same view of the caller's tensor for
    the outputs the build found to be views whatever the strides; others (``reshape`` copies a strided
    tensor in eager, ``reshape(-1)[:3]`` a view of that copy) stay the loader's own."""
    import torch

    loader = loader_module(tmp_path)
    views = {
        "t": lambda v: v.t(),
        "row": lambda v: v[1],
        "columns": lambda v: v[1:, ::2],
        "diagonal": lambda v: v.diagonal(),
        "expanded": lambda v: v.unsqueeze(0).expand(2, 6, 4),
        "copied then sliced": lambda v: v.reshape(-1)[:3],
    }
    recorded = [(i, 0) for i, name in enumerate(views) if name != "copied then sliced"]
    for mutated in (False, True):
        model = fake_model(
            loader,
            (torch.zeros(6, 4),),
            [f(torch.zeros(6, 4)) for f in views.values()],
            lambda flat: [f(flat[0].detach()) for f in views.values()],  # as the runner: no graph
            views=recorded,
            mutated=mutated,
        )
        needs_grad = [] if mutated else [torch.randn(4, 6).t().requires_grad_()]  # eager could not write it
        for x in (torch.randn(6, 8)[:, ::2], torch.randn(4, 6).t(), *needs_grad):
            for name, out, eager in zip(views, model(x), (f(x) for f in views.values())):
                assert torch.equal(out, eager) and not out.requires_grad, name
                shares = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                assert shares == (name != "copied then sliced"), name
                if shares:
                    assert out.stride() == eager.stride() and out.storage_offset() == eager.storage_offset(), name


def test_the_build_records_the_outputs_eager_makes_as_views_of_an_input() -> None:
    """Through ops that are views whatever the strides; not through ``view``/``reshape`` (on a strided
    tensor eager's ``reshape`` copies) nor any computation."""
    import torch

    from hatch_aoti.worker.entry import describe_outputs

    class Outputs(torch.nn.Module):
        def forward(self, x: Any, y: Any) -> Any:
            return x.t(), x[1:, ::2], x * 2, x.reshape(-1)[:3], y.diagonal(), y, x.unsqueeze(0).expand(2, 6, 4), 7

    exported = torch.export.export(Outputs(), (torch.randn(6, 4), torch.randn(3, 3)))
    views = [out.get("view_of") for out in describe_outputs(exported)]
    assert views == [0, 0, None, None, 1, 1, 0, None]


# -- 4. Dims that follow other dims ----------------------------------------------------------------------


@pytest.mark.integration
def test_dims_related_by_a_rule_build_and_are_enforced(fidelity: Runtime, fidelity_wheel: tuple[Path, str]) -> None:
    log = fidelity_wheel[1]
    assert "frames: dims are related, as torch.export found: _dim0 in [10, 20], dim0 = 320*_dim0" in log
    result = in_runtime(
        fidelity,
        """
        out = {}
        for name in ("frames", "framed"):
            model, eager = compiled.load(name), models.frames()
            x = torch.randn(2, 4800)
            assert_close(model(x), eager(x))
            try:
                model(torch.randn(2, 4801))
                out[name] = None
            except ValueError as exc:
                out[name] = str(exc)
            out[name + " info"] = compiled.info(name)["dynamic"]
        print(json.dumps(out))
    """,
    )
    assert "with dim0 = 320*_dim0]; got float32 on cpu with shape [2, 4801]" in result["frames"]
    assert "samples in [3200, 6400] with samples = 320*frames]" in result["framed"]
    assert result["framed info"] == {
        "frames": {"min": 10, "max": 20},
        "samples": {"min": 3200, "max": 6400, "rule": "320*frames"},
    }
    assert result["frames info"]["dim0"] == {"min": 3200, "max": 6400, "rule": "320*_dim0"}


def test_rules_in_the_dynamic_table_are_checked() -> None:
    from hatch_aoti.settings.constants import HATCH_TABLE
    from hatch_aoti.settings.reader import ConfigError
    from hatch_aoti.settings.resolve import parse_settings

    def problems(dynamic: dict[str, Any]) -> dict[str, str]:
        table = {"models": {"m": {"factory": "a:b", "inputs": [{"shape": [2, "samples"]}], "dynamic": dynamic}}}
        try:
            parse_settings(table, machine="x86_64", flags=set())
        except ConfigError as exc:
            return {path.removeprefix(f"{HATCH_TABLE}.models.m.dynamic."): message for path, message in exc.problems}
        return {}

    assert problems({"samples": "320*frames", "frames": {"min": 10, "max": 20}}) == {}
    assert problems({"samples": "2*samples + 1"})["samples"].endswith("not a derived one")
    assert "names 'frames', which no input shape uses" in problems({"samples": "320*frames"})["samples"]
    assert "must be a rule like" in problems({"samples": "frames ** 2", "frames": {}})["samples"]
    assert "is -10 at frames = 0" in problems({"samples": "frames - 10", "frames": {}})["samples"]
    assert problems({"samples": "frames - 10", "frames": {"min": 10}}) == {}
    assert problems({"samples": 3})["samples"] == "must be a table or a string, not 3"


def test_the_relations_torch_suggests_are_read_from_its_message() -> None:
    from hatch_aoti.settings.model import DimSpec
    from hatch_aoti.worker.inputs import suggested_rules

    message = textwrap.dedent("""\
        Constraints violated (samples)! ...
        Suggested fixes:
          _samples = Dim('_samples', min=10, max=20)
          samples = 320*_samples

        The error above occurred when calling torch.export.export.""")
    assert suggested_rules(message, {"samples"}, {}) == {"_samples": DimSpec(10, 20), "samples": "320*_samples"}
    assert suggested_rules(message.replace(", min=10", ""), {"samples"}, {})["_samples"] == DimSpec(2, 20), (
        "torch leaves out a min of 2"
    )
    assert suggested_rules(message.replace("320*_samples", "320"), {"samples"}, {}) is None, "no static sizes"
    narrower = message.replace("_samples = Dim('_samples'", "samples = Dim('samples'")
    assert suggested_rules(narrower, {"samples"}, {}) is None, "narrower bounds than declared are not applied"
    assert suggested_rules("no suggestions", {"samples"}, {}) is None
    chained = message.replace("  _samples = Dim('_samples', min=10, max=20)\n", "").replace("_samples", "frames")
    assert suggested_rules(chained, {"samples", "frames", "n"}, {}) == {"samples": "320*frames"}
    assert suggested_rules(chained, {"samples", "frames", "n"}, {"frames": ("n", 2, 0)}) is None, "no rule over a rule"
    assert suggested_rules(chained, {"samples", "frames", "n"}, {"n": ("samples", 2, 0)}) is None


# -- 5. Precompile over the whole range ----------------------------------------------------------------------


@pytest.mark.integration
def test_precompile_covers_its_whole_range_in_regions(fidelity: Runtime) -> None:
    result = in_runtime(
        fidelity,
        """
        info = compiled.info("conv")
        model, eager = compiled.load("conv"), models.convnet().eval()
        sizes = sorted({b for r in info["regions"] for b in r["dims"]["batch"]})
        with torch.no_grad():
            for batch in sizes:
                x = torch.randn(batch, 3, 16, 16)
                assert_close(model(x), eager(x))
        print(json.dumps({"regions": [r["dims"]["batch"] for r in info["regions"]], "checked": sizes,
                          "tried": [t["inputs"] for t in info["verification"]["tried"]]}))
    """,
    )
    regions = result["regions"]
    assert regions[0] == [1, 1] and regions[-1][1] == 64 and len(regions) >= 2
    assert all(a[1] + 1 == b[0] for a, b in zip(regions, regions[1:])), "the regions cover 1-64 without gaps"
    assert sum(t.startswith("region ") for t in result["tried"]) >= 2 * len(regions) - 1, "the build checked each edge"


def test_a_guard_narrower_than_the_region_splits_it() -> None:
    import torch

    from hatch_aoti.backends.interface import InputPlan
    from hatch_aoti.backends.precompile import _small_sizes_apart, _split

    plan = InputPlan(
        ((torch.ones(2, 3),), {"mask": torch.ones(2, 3)}),
        [],
        None,
        {"batch": (1, 64)},
        {},
        [{0: "batch"}, {0: "batch"}],
    )
    guard = (
        "Not all values of L['args'][0].size()[0] in the specified range L['args'][0].size()[0] <= 64 satisfy "
        "the generated guard 2 <= L['args'][0].size()[0] and L['args'][0].size()[0] <= 15"
    )
    assert _split({"batch": [2, 64]}, RuntimeError(guard), plan) == [{"batch": [2, 15]}, {"batch": [16, 64]}]
    kwargs = guard.replace("L['args'][0]", "L['kwargs']['mask']").replace("<= 15", "< 9")
    assert _split({"batch": [2, 64]}, RuntimeError(kwargs), plan) == [{"batch": [2, 8]}, {"batch": [9, 64]}]
    assert _split({"batch": [2, 64]}, RuntimeError("another failure"), plan) is None
    assert _small_sizes_apart({"batch": [1, 64]}) == [{"batch": [1, 1]}, {"batch": [2, 64]}]
    assert _small_sizes_apart({"batch": [0, None]}) == [{"batch": [0, 0]}, {"batch": [1, None]}]
    assert _small_sizes_apart({"batch": [2, 64]}) is None


# -- 6. CPU features as the CPU reports them ---------------------------------------------------------------


def loader_module(tmp_path: Path) -> Any:
    """The loader package that every wheel gets (its functions need no model): hatch-aoti's own copy,
    with the modules these tests reach into."""
    import importlib

    for module in ("calls", "engine", "host", "inputs", "runtime"):
        importlib.import_module(f"hatch_aoti.loader.{module}")
    return importlib.import_module("hatch_aoti.loader")


def test_the_cpus_own_report_wins_over_proc_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = loader_module(tmp_path)
    monkeypatch.setattr(loader.host, "host_flags", lambda: None)  # no /proc/cpuinfo: the check cannot use this host's
    cpu = {"arch": "x86_64", "target": "native", "features": ["avx2", "avx512f", "avx512_bf16"]}
    proc = {"avx2", "avx512f", "avx512_bf16"}
    assert loader.host.cpu_problem(cpu, "x86_64", proc, {"avx2": True, "avx512_f": True, "avx512_bf16": True}) is None
    # an emulator's /proc shows the host's; CPUID says what this CPU has
    found = loader.host.cpu_problem(cpu, "x86_64", proc, {"avx2": True, "avx512_f": False, "avx512_bf16": True})
    assert "this CPU lacks avx512f." in found
    # CPUID says nothing of a feature: /proc decides
    found = loader.host.cpu_problem(cpu, "x86_64", proc - {"avx512_bf16"}, {"avx2": True, "avx512_f": True})
    assert "this CPU lacks avx512_bf16." in found
    assert loader.host.cpu_problem(cpu, "x86_64", None, {}) is None  # nothing to ask: not refused


def test_the_loader_names_everything_that_stops_a_model_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``host.problems``: what ``load()`` refuses with and ``hatch-aoti`` reports, found without loading."""
    import platform

    import torch

    loader = loader_module(tmp_path)
    here = {"arch": os.uname().machine, "target": "x86-64-v3", "features": []}
    models = {
        "fine": {"cpu": here, "device": "cpu"},
        "elsewhere": {"cpu": {**here, "arch": "riscv64"}, "device": "cpu"},
        "gpu": {"cpu": here, "device": "cuda:0"},
        "old": {"cpu": here, "device": "cpu", "backend": "precompile", "python": "3.0.0", "torch": "1.0.0"},
        "same": {"cpu": here, "device": "cpu", "backend": "precompile", "python": platform.python_version(),
                 "torch": torch.__version__},
    }  # fmt: skip
    assert loader.host.problems(models["fine"], torch) == [] and loader.host.problems(models["same"], torch) == []
    (arch,) = loader.host.problems(models["elsewhere"])
    assert arch.startswith("was built for riscv64 CPUs")
    if not torch.cuda.is_available():
        assert loader.host.problems(models["gpu"], torch)[0].endswith("sees no CUDA device")
    (old,) = loader.host.problems(models["old"], torch)
    assert old.startswith("was precompiled with Python 3.0.0 and torch 1.0.0, and loads only there")
    monkeypatch.setenv("HATCH_AOTI_PACK", "fast")
    (pack,) = loader.host.problems(models["fine"], torch)
    assert pack == "cannot load here: HATCH_AOTI_PACK='fast': expected one of convolutions, all, none"


QEMU = shutil.which("qemu-x86_64")


@pytest.mark.integration
@pytest.mark.skipif(QEMU is None or sys.platform != "linux", reason="qemu-user (apt qemu-user) is not installed")
def test_an_emulated_older_cpu_is_refused_cleanly(
    fidelity_wheel: tuple[Path, str], runtime: Runtime, tmp_path: Path
) -> None:
    """Under ``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512), /proc/cpuinfo still shows the host's flags."""
    with zipfile.ZipFile(fidelity_wheel[0]) as zf:
        zf.extractall(tmp_path)
    manifest_path = tmp_path / "fidpkg" / "_aoti" / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["models"]["numbers"]["cpu"]["features"] += ["avx512f", "avx512bw"]  # as a build for AVX-512 has
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    code = (
        "import torch\nfrom fidpkg import compiled\ntry:\n    compiled.load('numbers')\n    print('loaded')\n"
        "except RuntimeError as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    emulated = run([QEMU, "-cpu", "Haswell", str(runtime.python), "-c", code], env=env, cwd=tmp_path)
    assert "this CPU lacks avx512f, avx512bw" in emulated.stdout, emulated.stdout + emulated.stderr
    if "avx512f" in Path("/proc/cpuinfo").read_text(encoding="utf-8"):
        host = run([str(runtime.python), "-c", code], env=env, cwd=tmp_path)
        assert host.stdout.strip() == "loaded", "the host has AVX-512: the same check lets it load"


# -- the command line, on the same wheel ---------------------------------------------------------------


@pytest.mark.integration
def test_hatch_aoti_verify_runs_every_call_structure_against_eager(fidelity_wheel: tuple[Path, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hatch_aoti", "verify", str(fidelity_wheel[0]), "--eager", "--import-package", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    data = json.loads(proc.stdout)
    statuses = {name: (r["status"], r["reason"]) for name, r in data["models"].items()}
    assert all(status == "ok" for status, _ in statuses.values()), statuses
    assert proc.returncode == 0
    cases = [c["inputs"] for c in data["models"]["framed"]["cases"]]
    assert cases == ["float32[2, 3200]", "float32[2, 4800]", "float32[2, 6400]"], "the build's: frames = 10, 15, 20"
    assert all(c["the_builds_inputs"] for c in data["models"]["framed"]["cases"]), "remade from the manifest"
    samples = data["models"]["frames"]["cases"]
    assert [c["case"] for c in samples] == ["sample 0", "sample 1"], "the project's own samples, at their sizes"
    assert not any(c["the_builds_inputs"] for c in samples), "made anew at the samples' sizes"


# -- a damaged install ----------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["cut", "removed"])
def test_a_shipped_file_cut_short_or_missing_is_refused_before_it_is_loaded(
    fidelity_wheel: tuple[Path, str], runtime: Runtime, tmp_path: Path, damage: str
) -> None:
    """Loaded, a library cut short ends the process (SIGBUS): its size is checked against the build's first."""
    with zipfile.ZipFile(fidelity_wheel[0]) as zf:
        zf.extractall(tmp_path)
    entry = json.loads((tmp_path / "fidpkg" / "_aoti" / "manifest.json").read_text())["models"]["mutates"]
    library = tmp_path / "fidpkg" / "_aoti" / "mutates" / entry["file"]
    assert entry["sizes"][entry["file"]] == library.stat().st_size
    if damage == "cut":
        with library.open("r+b") as f:
            f.truncate(100_000)
    else:
        library.unlink()
    proc = runtime.run(
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from fidpkg import compiled; compiled.load('mutates')",
        check=False,
    )
    state = "is missing" if damage == "removed" else f"has 100000 bytes, not the {entry['sizes'][entry['file']]}"
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"compiled model 'mutates' cannot load: its file {entry['file']} {state}" in proc.stderr, proc.stderr
    assert "the install is damaged (reinstall the package)" in proc.stderr


# -- a library that needs what the running torch lacks -------------------------------------------------------


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler to make the library")
def test_a_library_that_needs_a_symbol_torch_lacks_is_refused_by_name(
    fidelity_wheel: tuple[Path, str], runtime: Runtime, tmp_path: Path
) -> None:
    from hatch_aoti.pipeline.tagging import torch_symbols

    source = tmp_path / "needs.c"
    source.write_text(
        "void aoti_torch_hatch_aoti_missing_v9(void);\nint run(void) { aoti_torch_hatch_aoti_missing_v9(); "
        "return 0; }\n",
        encoding="utf-8",
    )
    library = tmp_path / "needs.so"
    run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)])
    assert torch_symbols(library) == ["aoti_torch_hatch_aoti_missing_v9"], "recorded from its ELF dynamic symbols"
    site = tmp_path / "site"
    with zipfile.ZipFile(fidelity_wheel[0]) as zf:
        zf.extractall(site)
    manifest_path = site / "fidpkg" / "_aoti" / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    entry = manifest["models"]["numbers"]
    assert "aoti_torch_empty_strided" in entry["torch_symbols"], "what a real library takes from libtorch"
    del entry["sizes"]  # the library is replaced with others: not refused as damaged
    shutil.copyfile(library, site / "fidpkg" / "_aoti" / "numbers" / entry["file"])
    code = (
        "from fidpkg import compiled\ntry:\n    compiled.load('numbers')\nexcept RuntimeError as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    for recorded in (True, False):  # checked before loading; a manifest without the record: the loader's error
        entry["torch_symbols"] = torch_symbols(library) if recorded else []
        manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
        proc = run([str(runtime.python), "-c", code], env=env, cwd=tmp_path)
        assert "compiled model 'numbers' was built with torch 2.13.0" in proc.stdout, proc.stdout + proc.stderr
        assert "aoti_torch_hatch_aoti_missing_v9, which this torch (2.13.0" in proc.stdout
        assert "Traceback" not in proc.stderr
    source.write_text("int run(void) { return 0; }\n", encoding="utf-8")  # loads, but is no model container
    run(["gcc", "-shared", "-fPIC", "-o", str(site / "fidpkg" / "_aoti" / "numbers" / entry["file"]), str(source)])
    proc = run([str(runtime.python), "-c", code], env=env, cwd=tmp_path)
    assert "compiled model 'numbers' was built with torch 2.13.0" in proc.stdout, proc.stdout + proc.stderr
    assert (
        "calls AOTInductorModelContainerCreateWithDevice, which the library lacks: a model container it does not know"
        in proc.stdout
        and "Traceback" not in proc.stderr
    )


# -- the torch requirement: the prepared metadata is the wheel's ---------------------------------------------


@pytest.mark.integration
def test_the_declared_torch_is_the_only_one(fidelity_wheel: tuple[Path, str]) -> None:
    from test_torch_window import requires_dist, wheel_metadata

    assert requires_dist(wheel_metadata(fidelity_wheel[0])) == ["torch==2.13.0"], "none added beside it"


# -- calls at once: the pool of model instances ------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 2])
def test_calls_waiting_for_an_instance_take_turns(tmp_path: Path, limit: int) -> None:
    """Four threads call a model of ``limit`` instances 2000 times each, switching between any two steps:
    no more than ``limit`` calls run at once, a call waits for about the calls that were waiting before
    it (the one giving an instance back, which holds the GIL, does not win it again and again; it did, a
    call then waited while thousands ran), and every
    instance is free again at the end, also after calls that raised."""
    import threading
    import time

    loader = loader_module(tmp_path)
    running, most, events = [0], [0], []

    class Instance:
        get_call_spec = get_constant_names_to_original_fqns = None

        def run(self, inputs: list[Any]) -> list[Any]:
            events.append(("run", inputs[0]))
            running[0] += 1
            most[0] = max(most[0], running[0])
            time.sleep(0)  # lets another thread in, as a real run does (it releases the GIL)
            running[0] -= 1
            if inputs[1] % 500 == 0:
                raise RuntimeError("the run failed")
            return inputs

    made: list[Instance] = []
    pool = loader.runtime.Pool(lambda: made.append(Instance()) or made[-1], limit)
    failures: list[BaseException] = []  # a thread's exception is only a warning: the test raises them here

    def caller(index: int) -> None:
        try:
            for i in range(2000):
                events.append(("call", index))
                try:
                    assert pool.run([index, i]) == [index, i]
                except RuntimeError:
                    pass
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps, as on a busy server
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    if failures:
        raise failures[0]
    assert most[0] <= limit and len(made) <= limit and sorted(map(id, pool._free)) == sorted(map(id, made))
    ahead, longest = {}, 0  # runs of other threads between a call and its own run
    for kind, index in events:
        if kind == "call":
            ahead[index] = 0
        else:
            longest = max(longest, ahead.pop(index))
            for other in ahead:
                ahead[other] += 1
    # In turn, a handful (more where the machine keeps a thread from the GIL); thousands where the giver wins.
    assert longest <= 200, f"a call waited while {longest} calls of other threads ran"


@pytest.mark.parametrize("path", ["free", "made"])
def test_an_instance_is_handed_back_whatever_is_raised_before_its_run(tmp_path: Path, path: str) -> None:
    """A KeyboardInterrupt (injected here at every step of the call before the instance runs, as a signal
    handler may raise it) never loses the instance: with one instance, a lost one made every later call
    wait forever."""
    import dis

    loader = loader_module(tmp_path)

    class Instance:
        get_call_spec = get_constant_names_to_original_fqns = None

        def run(self, inputs: list[Any]) -> list[Any]:
            return inputs

    pool = loader.runtime.Pool(Instance, 2)
    # the steps of the call up to its instance's run (an exception inside that run is the run's own), and
    # of the one step that takes a free instance (``_take``'s lock is Python's own ``with``, whose entry
    # a signal can interrupt too: a case of CPython's, not the pool's)
    frames = [pool.run.__code__, pool._pop.__code__]
    steps = [(code, i.offset) for code in frames[1:] for i in dis.get_instructions(code)]
    for instruction in dis.get_instructions(frames[0]):
        steps.append((frames[0], instruction.offset))
        if instruction.argval == "run":
            break
    for code, offset in steps:

        def inject(frame: Any, event: str, arg: Any, code: Any = code, offset: int = offset) -> Any:
            if frame.f_code is code:
                frame.f_trace_opcodes = True
                if event == "opcode" and frame.f_lasti == offset:
                    raise KeyboardInterrupt
            return inject

        if path == "made":  # none free: the call makes the second instance
            pool._free.clear()
            pool._all[1:] = []
        sys.settrace(inject)
        try:
            pool.run([1])
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if path == "made":
            assert len(pool._free) <= 1, "the one taken away is not handed back"
            pool._free[:] = pool._all
        assert sorted(map(id, pool._free)) == sorted(map(id, pool._all)), f"lost at {code.co_name}:{offset}"
        assert pool.run([2]) == [2]
