"""Example-input planning and dynamic-dim inference (torch, no compiling)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hatch_aoti.settings.model import DimSpec, TensorSpec
from hatch_aoti.settings.spec import ModelSpec
from hatch_aoti.worker.inputs import (
    InputError,
    normalise_samples,
    plan_declared,
    plan_from_samples,
)


def spec(**overrides) -> ModelSpec:
    base = dict(name="m", factory="a:b", inputs=(), kwargs={}, example_inputs=None, dynamic={})
    return ModelSpec(**{**base, **overrides})


def dim_info(d) -> tuple[str, int, int]:
    return d.__name__, d.min, d.max


def test_declared_inputs_dims_and_verification_points() -> None:
    model = spec(
        inputs=(TensorSpec(("batch", "seq"), "int64", low=0, high=50),),
        kwargs={"mask": TensorSpec(("batch", "seq"), "bool")},
        dynamic={"batch": DimSpec(1, 8), "seq": DimSpec(4, 32)},
    )
    plan = plan_declared(model, ["tokens", "mask"])
    (tokens,), kwargs = plan.export_sample
    assert tokens.shape == (2, 4) and tokens.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 50
    assert kwargs["mask"].dtype == torch.bool and kwargs["mask"].shape == (2, 4)
    assert plan.dims == {"batch": (1, 8), "seq": (4, 32)}
    shapes = {label: s[0][0].shape for label, s in plan.verify_samples}
    assert shapes == {"example": (2, 4), "min": (1, 4), "mid": (4, 18), "max": (8, 32)}
    batch = plan.dynamic_shapes["tokens"][0]
    assert plan.dynamic_shapes["mask"][0] is batch, "the same name in two places is one dim"
    assert dim_info(batch) == ("batch", 1, 8)
    assert plan.axis_names == [{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}]


def test_declared_samples_are_deterministic() -> None:
    model = spec(inputs=(TensorSpec((3, 5), "float32"),))
    a = plan_declared(model, ["x"]).export_sample[0][0]
    b = plan_declared(model, ["x"]).export_sample[0][0]
    assert torch.equal(a, b)


def test_unbounded_named_dim_is_dynamic_with_auto_range() -> None:
    plan = plan_declared(spec(inputs=(TensorSpec(("n", 3), "float32"),)), ["x"])
    assert plan.dims == {"n": (0, None)}
    assert [label for label, _ in plan.verify_samples] == ["example", "mid", "max"]


def test_samples_infer_shared_batch_and_separate_dims() -> None:
    samples = [
        ((torch.zeros(2, 7, 3, dtype=torch.long),), {"mask": torch.ones(2, 7, dtype=torch.bool)}),
        ((torch.zeros(6, 9, 3, dtype=torch.long),), {"mask": torch.ones(6, 9, dtype=torch.bool)}),
        ((torch.zeros(4, 5, 3, dtype=torch.long),), {"mask": torch.ones(4, 5, dtype=torch.bool)}),
    ]
    plan = plan_from_samples(spec(example_inputs="a:c"), samples, ["tokens", "mask"])
    assert plan.dims == {"batch": (2, 6), "dim1": (5, 9)}
    tokens, mask = plan.dynamic_shapes["tokens"], plan.dynamic_shapes["mask"]
    assert set(tokens) == {0, 1} and 2 not in tokens, "an axis that never varies stays static"
    assert tokens[0] is mask[0] and tokens[1] is mask[1]
    assert [label for label, _ in plan.verify_samples] == ["sample 0", "sample 1", "sample 2"]


def test_samples_dims_that_move_together_are_one_dim() -> None:
    samples = [((torch.zeros(2, 2), torch.zeros(2, 4)), {}), ((torch.zeros(3, 3), torch.zeros(3, 6)), {})]
    plan = plan_from_samples(spec(example_inputs="a:c"), samples, ["x", "y"])
    assert plan.dims == {"batch": (2, 3), "dim1": (4, 6)}, "equal sizes share a dim; proportional ones do not"
    x, y = plan.dynamic_shapes["x"], plan.dynamic_shapes["y"]
    assert x[0] is x[1] is y[0] and y[1] is not y[0]


def test_dynamic_widens_inferred_bounds_and_adds_verification_points() -> None:
    samples = [((torch.zeros(2, 5),), {}), ((torch.zeros(6, 5),), {})]
    model = spec(example_inputs="a:c", dynamic={"batch": DimSpec(1, 32)})
    plan = plan_from_samples(model, samples, ["x"])
    assert plan.dims == {"batch": (1, 32)}
    extra = {label: s[0][0].shape for label, s in plan.verify_samples[2:]}
    assert extra == {"min": (1, 5), "max": (32, 5)}


def test_export_sample_avoids_size_one() -> None:
    samples = [((torch.zeros(1, 5),), {}), ((torch.zeros(4, 5),), {})]
    plan = plan_from_samples(spec(example_inputs="a:c"), samples, ["x"])
    assert plan.export_sample[0][0].shape == (4, 5)
    assert plan.dims == {"batch": (1, 4)}


@pytest.mark.parametrize(
    ("samples", "key", "fragment"),
    [
        ([((torch.zeros(2, 5),), {}), ((torch.zeros(2, 5, 1),), {})], "example-inputs", "rank"),
        ([((torch.zeros(2),), {}), ((torch.zeros(2),), {"k": torch.zeros(1)})], "example-inputs", "structure"),
    ],
)
def test_inconsistent_samples(samples, key: str, fragment: str) -> None:
    with pytest.raises(InputError) as info:
        plan_from_samples(spec(example_inputs="a:c"), samples, ["x"])
    assert info.value.key == key and fragment in str(info.value)


def test_dynamic_name_must_match_an_inferred_dim() -> None:
    samples = [((torch.zeros(2, 5),), {}), ((torch.zeros(6, 5),), {})]
    with pytest.raises(InputError) as info:
        plan_from_samples(spec(example_inputs="a:c", dynamic={"seq": DimSpec(1, 9)}), samples, ["x"])
    assert info.value.key == "dynamic.seq" and "inferred: batch" in str(info.value)


def test_the_export_sample_is_contiguous_and_the_others_keep_their_layout() -> None:
    images = torch.rand(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    samples = [((images,), {}), ((images[:2],), {})]
    plan = plan_from_samples(spec(example_inputs="a:c"), samples, ["x"])
    (exported,), _ = plan.export_sample
    assert exported.is_contiguous() and torch.equal(exported, images)
    assert plan.verify_samples[0][1] is plan.export_sample, "named `sample 0` in messages"
    assert not plan.verify_samples[1][1][0][0].is_contiguous(), "verified through the loader as given"


def test_normalise_samples_forms() -> None:
    x = torch.zeros(1)
    assert normalise_samples((x,)) == [((x,), {})]
    assert normalise_samples(((x,), {"k": x})) == [((x,), {"k": x})]
    assert len(normalise_samples([(x,), ((x,), {})])) == 2
    with pytest.raises(InputError):
        normalise_samples([])
    with pytest.raises(InputError):
        normalise_samples("nope")


def test_dynamic_may_widen_inferred_bounds_but_not_narrow_them() -> None:
    samples = normalise_samples([(torch.zeros(2, 3),), (torch.zeros(6, 3),)])
    wide = plan_from_samples(spec(dynamic={"batch": DimSpec(1, 32)}, example_inputs="a:c", inputs=None), samples, ["x"])
    assert wide.dims == {"batch": (1, 32)}
    for bounds, key, fragment in (
        (DimSpec(min=4), "dynamic.batch.min", "above the smallest size"),
        (DimSpec(max=5), "dynamic.batch.max", "below the largest size"),
    ):
        with pytest.raises(InputError) as info:
            plan_from_samples(spec(dynamic={"batch": bounds}, example_inputs="a:c", inputs=None), samples, ["x"])
        assert info.value.key == key and fragment in str(info.value)


def test_verify_remakes_the_builds_inputs_from_the_manifest() -> None:
    """One generator: the inputs ``hatch-aoti verify`` makes from the manifest are the tensors the build
    verified with, case by case (torch.export, no compiling)."""
    from torch.utils import _pytree as pytree

    from hatch_aoti.cli import calls
    from hatch_aoti.worker.entry import call_spec, describe_call

    class Model(torch.nn.Module):
        def forward(self, tokens, scale, *, mask):
            return (tokens.float() * scale).sum(-1) + mask.float().sum(-1)

    model = spec(
        inputs=(TensorSpec(("batch", "seq"), "int64", low=3, high=40), TensorSpec((1,), "float16", low=-2, high=2)),
        kwargs={"mask": TensorSpec(("batch", "seq"), "bool")},
        dynamic={"batch": DimSpec(1, 8), "seq": DimSpec(4, 32)},
    )
    plan = plan_declared(model, ["tokens", "scale", "mask"], seed=7)
    args, kwargs = plan.export_sample
    exported = torch.export.export(Model(), args, kwargs, dynamic_shapes=plan.dynamic_shapes)
    tried = [
        {"inputs": label, "shapes": [list(t.shape) for t in pytree.tree_leaves(s)], "seed": plan.seed}
        for label, s in plan.verify_samples
    ]
    entry = {"call": describe_call(exported, plan), "verification": {"tried": tried}}
    assert entry["call"][0]["low"] == 3 and entry["call"][0]["high"] == 40 and "low" not in entry["call"][2]
    cases = calls.cases(entry)
    assert [c.label for c in cases] == ["example", "min", "mid", "max"]
    for case, (_, sample) in zip(cases, plan.verify_samples, strict=True):
        remade = calls.make_inputs(entry, case.sizes, call_spec(exported)[0], case.seed)
        torch.testing.assert_close(remade, sample, rtol=0, atol=0)


def test_inputs_remade_for_samples_keep_the_integers_the_samples_hold() -> None:
    small, large = torch.randint(5, 9, (2, 3)), torch.randint(5, 12, (4, 3))
    plan = plan_from_samples(spec(), [((small, torch.randn(2)), {}), ((large, torch.randn(4)), {})], ["ids", "x"])
    assert plan.seed is None and plan.values == [
        (int(min(small.min(), large.min())), int(max(small.max(), large.max())) + 1),
        (None, None),
    ]
