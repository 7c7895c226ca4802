"""Property-based tests: malformed tables and random calls never escape as anything but clear errors."""

from __future__ import annotations

import copy
import math
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hatch_aoti.settings import reader
from hatch_aoti.settings.constants import DTYPES, HATCH_TABLE
from hatch_aoti.settings.cpu_targets import X86_64_V4
from hatch_aoti.settings.reader import ConfigError
from hatch_aoti.settings.resolve import parse_settings

VALID: dict[str, Any] = {
    "package": "pkg",
    "loader": "compiled",
    "torch-requirement": "torch>=2.13,<2.15",
    "cpu-target": "x86-64-v3",
    "models": {
        "mlp": {
            "factory": "pkg.models:mlp",
            "inputs": [{"shape": ["batch", 8], "dtype": "float32", "low": 0, "high": 1}],
            "kwargs": {"mask": {"shape": ["batch", 8], "dtype": "bool", "device": "cpu"}},
            "dynamic": {"batch": {"min": 1, "max": 8}},
            "device": "cpu",
            "inductor-configs": {"max_autotune": False},
            "rtol": 1e-4,
            "atol": 1e-5,
            "verify": True,
            "cpu-target": "x86-64-v3",
        },
        "tok": {"factory": "pkg.models:tok", "example-inputs": "pkg.models:samples", "dynamic": {"batch": {}}},
    },
}

# What tomllib can hand us: strings, integers, floats (inf and nan too), booleans, dates and
# times, arrays and tables.
scalars = st.one_of(
    st.text(max_size=12),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.booleans(),
    st.datetimes(),
    st.dates(),
    st.times(),
    st.sampled_from(["float32", "bool", "cpu", "cuda:1", "native", "x86-64-v4", "a:b", "batch", "", "torch"]),
)
toml_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a table, as keys and indices."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += paths(value, (*prefix, index))
    return out


def _at(table: Any, where: tuple[Any, ...]) -> Any:
    for part in where:
        table = table[part]
    return table


def toml_path(where: tuple[Any, ...]) -> str:
    path = HATCH_TABLE
    for part in where:
        path = f"{path}[{part}]" if isinstance(part, int) else reader.toml_path(path, part)
    return path


def related(problem: str, mutated: str) -> bool:
    """The problem is about the mutated place, what contains it, what it contains, or its model."""
    if problem == mutated or problem.startswith((f"{mutated}.", f"{mutated}[")) or mutated.startswith(problem):
        return True
    model = f"{HATCH_TABLE}.models."
    if mutated.startswith(model) and problem.startswith(model):
        return mutated[len(model) :].split(".")[0] == problem[len(model) :].split(".")[0]
    return False


def check_table(table: dict[str, Any], where: tuple[Any, ...], value: Any) -> None:
    """Refused with a problem about the mutated place, or accepted with exactly that value there."""
    mutated = toml_path(where)
    try:
        settings = parse_settings(table, machine="x86_64", flags=set(X86_64_V4))
    except ConfigError as exc:
        assert exc.problems, "a ConfigError lists its problems"
        for path, message in exc.problems:
            assert isinstance(path, str) and isinstance(message, str) and message
        assert any(related(path, mutated) for path, _ in exc.problems), (mutated, exc.problems)
        assert str(exc).startswith("hatch-aoti found")
        return
    assert_reflects(parsed_at(settings, where), value, mutated)


def parsed_at(settings: Any, where: tuple[Any, ...]) -> Any:
    """What the parsed settings hold at a place of the table (models by name, keys as attributes)."""
    node: Any = settings
    for part in where:
        if node is settings and part == "models":
            node = {model.name: model for model in settings.models}
        elif isinstance(node, (dict, tuple, list)):
            node = node[part]
        else:
            node = getattr(node, str(part).replace("-", "_"))
    return node


def assert_reflects(parsed: Any, value: Any, where: str) -> None:
    if isinstance(value, dict) and not isinstance(parsed, dict):  # a table read into a dataclass
        for key, item in value.items():
            assert_reflects(getattr(parsed, key.replace("-", "_")), item, f"{where}.{key}")
    elif isinstance(value, dict):
        assert set(parsed) == set(value), where
        for key, item in value.items():
            assert_reflects(parsed[key], item, f"{where}.{key}")
    elif isinstance(value, list) and isinstance(parsed, tuple):
        assert len(parsed) == len(value), where
        for index, (got, item) in enumerate(zip(parsed, value)):
            assert_reflects(got, item, f"{where}[{index}]")
    else:
        same = parsed is value or parsed == value or (isinstance(value, str) and parsed == DTYPES.get(value))
        assert same, (where, parsed, value)  # `is`: a NaN passed through as it was


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.sampled_from(paths(VALID)), value=toml_values)
def test_any_value_anywhere_is_accepted_or_named(where: tuple[Any, ...], value: Any) -> None:
    table = copy.deepcopy(VALID)
    _at(table, where[:-1])[where[-1]] = value
    check_table(table, where, value)


@settings(max_examples=200, deadline=None)
@given(
    where=st.sampled_from([p for p in [(), *paths(VALID)] if isinstance(_at(VALID, p), dict)]),
    key=st.text(min_size=1, max_size=10),
    value=toml_values,
)
def test_any_key_anywhere_is_accepted_or_named(where: tuple[Any, ...], key: str, value: Any) -> None:
    table = copy.deepcopy(VALID)
    node = _at(table, where)
    assume(key not in node)
    node[key] = value
    check_table(table, (*where, key), value)


# -- random calls to a loaded model ------------------------------------------------------------


torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def sample(sample_dists: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """sample_project's wheel, unpacked and imported here (the loader needs only torch)."""
    target = tmp_path_factory.mktemp("fuzz-sample")
    with zipfile.ZipFile(sample_dists[1]) as zf:
        zf.extractall(target)
    sys.path.insert(0, str(target))
    try:
        from sample_models import compiled, models

        for name in compiled.names():  # loaded while the package can be imported: load() keeps them
            compiled.load(name)
    finally:
        sys.path.remove(str(target))
        for name in [m for m in sys.modules if m.split(".")[0] == "sample_models"]:
            del sys.modules[name]  # imported from here only: later tests find their own copies
    eager = {"mlp": models.build_mlp(), "classifier": models.build_classifier()}
    return compiled, eager


def tensors(shape: list[int]) -> st.SearchStrategy[Any]:
    """Tensors whose shape, dtype, device and layout are the expected ones, or close to them."""
    sizes = st.one_of(
        st.just(shape),
        st.lists(st.integers(0, 70), min_size=max(0, len(shape) - 1), max_size=len(shape) + 1),
        st.builds(
            lambda i, n: [n if j == i else s for j, s in enumerate(shape)],
            st.integers(0, len(shape) - 1),
            st.integers(0, 70),
        ),
    )
    dtypes = st.sampled_from([torch.float32, torch.float32, torch.float64, torch.float16, torch.int64, torch.bool])
    devices = st.sampled_from(["cpu", "cpu", "cpu", "meta"])
    layouts = st.sampled_from(["contiguous", "contiguous", "transposed", "strided", "channels_last"])

    def make(size: list[int], dtype: Any, device: str, layout: str) -> Any:
        return _laid_out((torch.rand(size) * 4 - 2).to(dtype).to(device), layout)

    return st.builds(make, sizes, dtypes, devices, layouts)


def not_tensors() -> st.SearchStrategy[Any]:
    import numpy

    arrays = st.builds(lambda n: numpy.zeros((4, n), dtype=numpy.float32), st.integers(0, 130))
    return st.one_of(
        st.none(), st.integers(), st.floats(), st.text(max_size=3), st.lists(st.floats(), max_size=3), arrays
    )


def calls(shape: list[int]) -> st.SearchStrategy[tuple[tuple[Any, ...], dict[str, Any]]]:
    argument = st.one_of(tensors(shape), tensors(shape), not_tensors())
    args = st.lists(argument, max_size=3).map(tuple)
    kwargs = st.dictionaries(st.sampled_from(["x", "images", "input", "scale"]), argument, max_size=2)
    return st.one_of(st.tuples(st.tuples(tensors(shape)), st.just({})), st.tuples(args, kwargs))


def matches_eager(model: Any, eager: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, valid: bool) -> bool:
    """Call the compiled model: a valid call must agree with eager; any other either raises TypeError or
    ValueError, or agrees with eager. True if the model took the call."""
    try:
        with torch.inference_mode():
            got = model(*args, **kwargs)
    except (TypeError, ValueError):
        if valid:
            raise
        return False
    with torch.inference_mode():
        want = eager(*args, **kwargs)
    got_leaves, want_leaves = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-5) or not math.isfinite(float(w.abs().max()))
    return True


def valid_tensor(shape: list[int]) -> st.SearchStrategy[Any]:
    """A tensor the model must take: the expected shape and dtype on the CPU, in any layout."""
    layouts = st.sampled_from(["contiguous", "transposed", "strided", "channels_last"])
    return st.builds(lambda layout: _laid_out(torch.rand(shape) * 4 - 2, layout), layouts)


def _laid_out(tensor: Any, layout: str) -> Any:
    if layout == "transposed" and tensor.dim() >= 2:  # same values, other strides
        return tensor.mT.contiguous().mT
    if layout == "strided" and tensor.dim() >= 1:  # gaps between elements
        return tensor.repeat_interleave(2, dim=-1)[..., ::2]
    if layout == "channels_last" and tensor.dim() == 4:
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor


@pytest.mark.integration
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_valid_calls_are_all_taken_and_match_eager(sample: Any, data: st.DataObject) -> None:
    model, eager, shape = drawn_model(sample, data)
    assert matches_eager(model, eager, (data.draw(valid_tensor(shape)),), {}, valid=True)


@pytest.mark.integration
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_calls_match_eager_or_raise_type_or_value_errors(sample: Any, data: st.DataObject) -> None:
    model, eager, shape = drawn_model(sample, data)
    args, kwargs = data.draw(calls(shape))
    taken = matches_eager(model, eager, args, kwargs, valid=False)
    assert taken == is_valid(args, kwargs, shape), "taken" if taken else "refused"


def is_valid(args: tuple[Any, ...], kwargs: dict[str, Any], shape: list[int]) -> bool:
    """Whether the model must take a call: one float32 CPU tensor of its shape, in any layout (the
    classifier's batch anywhere in its range), passed by position or by its parameter's name."""
    mlp = len(shape) == 2
    if len(args) + len(kwargs) != 1 or (kwargs and set(kwargs) != {"x" if mlp else "images"}):
        return False
    (value,) = (*args, *kwargs.values())
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.device.type != "cpu":
        return False
    if mlp:
        return list(value.shape) == shape
    return value.dim() == 4 and 1 <= value.shape[0] <= 64 and list(value.shape[1:]) == [3, 16, 16]


def drawn_model(sample: Any, data: st.DataObject) -> tuple[Any, Any, list[int]]:
    """One of the sample's models, compiled and eager, and the input shape it takes (any batch for the classifier)."""
    compiled, eager = sample
    name = data.draw(st.sampled_from(["mlp", "classifier"]))
    shape = [4, 128] if name == "mlp" else [data.draw(st.integers(1, 64)), 3, 16, 16]
    return compiled.load(name), eager[name], shape


@pytest.mark.integration
def test_inputs_of_any_layout_give_what_eager_gives(sample: Any) -> None:
    """The compiled code indexes inputs as contiguous; a convolution shows any other layout at once."""
    compiled, eager = sample
    for name, x in {"mlp": torch.rand(4, 128), "classifier": torch.rand(8, 3, 16, 16)}.items():
        views = {
            "transposed": x.mT.contiguous().mT,
            "strided": x.repeat_interleave(2, dim=-1)[..., ::2],
            "offset": torch.cat([x, x])[len(x) :],
            **({"channels_last": x.contiguous(memory_format=torch.channels_last)} if x.dim() == 4 else {}),
        }
        with torch.inference_mode():
            want = torch.utils._pytree.tree_leaves(eager[name](x))
            for layout, view in views.items():
                assert torch.equal(view, x) and view.is_contiguous() == (layout == "offset")
                got = torch.utils._pytree.tree_leaves(compiled.load(name)(view))
                assert all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want)), (name, layout)
            with pytest.raises(TypeError, match="must be a dense tensor"):
                compiled.load(name)(x.to_sparse())
