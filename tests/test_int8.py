"""The int8 program maker (hatch_aoti/worker/int8.py): what it quantizes, the module it leaves as it was,
and a program that runs, eagerly and compiled, close to the float32 model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")

from torch import nn
from torch.export import Dim

from hatch_aoti.worker.int8 import INSTALL, Quantized, int8_program, register_lowering
from hatch_aoti.worker.precision import has_vnni


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.c(torch.relu(self.b(torch.nn.functional.gelu(self.a(x)))))


class ConvNet(nn.Module):
    """Convolutions (one with batch norm, one residual) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.body = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = torch.relu(self.bn(self.stem(x)))
        h = torch.relu(self.body(h) + h)
        return self.head(h.mean((2, 3)))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP().eval()


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    model = ConvNet()
    with torch.no_grad():  # batch norm with statistics of its own, as a trained model has
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.uniform_(0.5, 1.5)
    return model.eval()


def images(batch: int, seed: int) -> Any:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def snapshot(module: nn.Module) -> dict[str, tuple[Any, Any]]:
    return {n: (t, t.detach().clone()) for n, t in [*module.named_parameters(), *module.named_buffers()]}


def assert_unchanged(module: nn.Module, before: dict[str, tuple[Any, Any]]) -> None:
    now = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    assert now.keys() == before.keys()
    for name, (tensor, values) in before.items():
        assert now[name] is tensor, f"{name} is another object"
        assert torch.equal(tensor, values), f"{name} changed"


def assert_close(out: Any, ref: Any) -> None:
    """Relative L2 error under 5%, cosine over 0.99."""
    out, ref = out.detach().double().flatten(), ref.detach().double().flatten()
    assert out.shape == ref.shape
    error = ((out - ref).norm() / ref.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(out, ref, dim=0).item()
    assert error < 0.05 and cosine > 0.99, (error, cosine)


def test_linear_layers_are_quantized_dynamically_for_any_batch() -> None:
    model, x = mlp(), torch.randn(4, 32)
    before = snapshot(model)
    program, quantized = int8_program(model, (x,), {}, {"x": {0: Dim("batch", min=1, max=64)}}, None)
    assert quantized == Quantized(linear=(3, 3), conv=(0, 0), calibrated=False, smoothed=3)
    assert quantized.describe() == "int8: 3 of 3 linear layers (3 smoothed), 0 of 0 convolutions"
    assert_unchanged(model, before)
    for batch in (1, 7, 64):
        x = torch.randn(batch, 32)
        assert_close(program.module()(x), model(x))


def test_smoothing_evens_out_an_outlier_channel_and_changes_nothing_in_exact_arithmetic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One input channel 100x the others, as language models' activations have: quantized per call with one
    scale, it costs every other channel its precision unless the layer is smoothed first."""
    from hatch_aoti.worker import int8
    from hatch_aoti.worker.smoothing import smoothed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(32, 64)
    x[:, 3] *= 100
    before = snapshot(model)
    smooth, count = smoothed(model, [((x,), {})])
    assert count == 2 and all(type(smooth[i]) is nn.Linear and smooth[i] is not model[i] for i in (0, 2))
    assert_unchanged(model, before)
    torch.testing.assert_close(smooth(x), model(x), rtol=1e-4, atol=1e-3)
    held_out = torch.randn(32, 64)
    held_out[:, 3] *= 100
    errors = {}
    for kind in ("smoothed", "plain"):
        program, quantized = int8_program(model, (x,), {}, None, None)
        out, ref = program.module()(held_out).double(), model(held_out).double()
        errors[kind] = float((out - ref).norm() / ref.norm())
        monkeypatch.setattr(int8, "smoothed", lambda module, samples: (module, 0))
    assert errors["smoothed"] < errors["plain"] / 2, errors


def test_the_program_holds_int8_weights_and_not_the_float32_ones() -> None:
    model = mlp()
    program, _ = int8_program(model, (torch.randn(4, 32),), {}, None, None)
    weights = {**program.state_dict, **program.constants}
    assert not any(t.dtype is torch.float32 and t.dim() == 2 for t in weights.values())
    assert sorted(t.shape for t in weights.values() if t.dtype is torch.int8) == sorted(
        m.weight.shape for m in (model.a, model.b, model.c)
    )


def test_convolutions_are_quantized_statically_on_the_calibration_samples() -> None:
    model = conv_net()
    before = snapshot(model)
    calibration = [((images(8, seed),), {}) for seed in range(4)]
    dynamic = {"x": {0: Dim("batch", min=1, max=32)}}
    program, quantized = int8_program(model, (images(4, 9),), {}, dynamic, calibration)
    assert quantized == Quantized(linear=(1, 1), conv=(2, 2), calibrated=True, smoothed=1)
    assert quantized.describe() == "int8: 1 of 1 linear layer (1 smoothed), 2 of 2 convolutions (calibrated)"
    assert_unchanged(model, before)  # batch norm folded into the program's weights, not the module's
    for batch, seed in ((1, 10), (5, 11), (32, 12)):
        x = images(batch, seed)
        assert_close(program.module()(x), model(x))


def test_without_calibration_convolutions_stay_float32() -> None:
    model, x = conv_net(), images(4, 9)
    program, quantized = int8_program(model, (x,), {}, None, None)
    assert quantized == Quantized(linear=(1, 1), conv=(0, 2), calibrated=False, smoothed=1)
    assert quantized.describe() == "int8: 1 of 1 linear layer (1 smoothed), 0 of 2 convolutions (no `calibration`)"
    assert_close(program.module()(x), model(x))


class Block(nn.Module):
    """GPT-2's use of transformers' Conv1D: an attention projection and an MLP with GPT-2's GELU, one
    Conv1D used twice."""

    def __init__(self, conv1d: Any, act: Any) -> None:
        super().__init__()
        self.attn, self.fc, self.proj = conv1d(96, 32), conv1d(64, 32), conv1d(32, 64)
        self.twice = self.proj
        self.norm, self.act = nn.LayerNorm(32), act

    def forward(self, x, *, scale):  # type: ignore[no-untyped-def]
        q, k, v = self.attn(self.norm(x)).split(32, dim=-1)
        h = x + torch.nn.functional.scaled_dot_product_attention(q, k, v) * scale
        m = self.act(self.fc(h))
        return self.proj(m) + self.twice(m * 0.5)


def test_transformers_conv1d_layers_are_quantized_as_linear_ones() -> None:
    transformers = pytest.importorskip("transformers.pytorch_utils")
    model = conv1d_block()
    before = snapshot(model)
    children = dict(model.named_children())
    x, scale = torch.randn(2, 12, 32), torch.tensor(0.5)
    dynamic = {"x": {1: Dim("seq", min=2, max=128)}, "scale": None}
    program, quantized = int8_program(model, (x,), {"scale": scale}, dynamic, None)
    assert quantized == Quantized(linear=(4, 4), conv=(0, 0), calibrated=False, smoothed=3)  # proj: twice
    int8 = [t for t in program.state_dict.values() if t.dtype is torch.int8]
    assert len(int8) == 3 and all(t.is_contiguous() for t in int8), "Inductor packs strided int8 weights wrongly"
    assert_unchanged(model, before)
    assert dict(model.named_children()) == children
    assert all(type(model.get_submodule(n)) is transformers.Conv1D for n in ("attn", "fc", "proj", "twice"))
    for seq in (2, 12, 128):
        x = torch.randn(2, seq, 32)
        assert_close(program.module()(x, scale=scale), model(x, scale=scale))


def test_gelu_written_out_in_its_tanh_form_becomes_one_op_in_the_int8_program() -> None:
    """GPT-2's GELU (transformers' ``gelu_new``), written out with ``tanh``, is ``gelu(approximate="tanh")`` in
    the program, which Inductor fuses into the int8 product; a formula written another way (transformers'
    ``gelu_fast``) stays as it is."""
    activations = pytest.importorskip("transformers.activations")
    gelu = torch.ops.aten.gelu.default
    for act, turned in ((activations.NewGELUActivation(), True), (activations.FastGELUActivation(), False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), act, nn.Linear(64, 8), act).eval()
        x = torch.randn(4, 32)
        program, _ = int8_program(model, (x,), {}, None, None)
        ops = [n for n in program.graph.nodes if n.op == "call_function"]
        tanh = [n for n in ops if n.target is torch.ops.aten.tanh.default]
        if turned:
            assert [n.kwargs for n in ops if n.target is gelu] == [{"approximate": "tanh"}] * 2 and not tanh
        else:
            assert len(tanh) == 2 and not any(n.target is gelu for n in ops)
        assert_close(program.module()(x), model(x))


def conv1d_block() -> nn.Module:
    transformers = pytest.importorskip("transformers.pytorch_utils")
    activations = pytest.importorskip("transformers.activations")
    torch.manual_seed(0)
    return Block(transformers.Conv1D, activations.NewGELUActivation()).eval()


class Narrow(nn.Module):
    """A convolution of 8 output channels, whose weight scales Inductor writes into its code rather than
    keeping them as a constant of the library, then a wider one and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow, self.bn, self.wide = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 16, 3)
        self.head = nn.Linear(16, 10)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.head(torch.relu(self.wide(torch.relu(self.bn(self.narrow(x))))).mean((2, 3)))


def compiled_as_shipped(program: Any, tmp_path: Path) -> tuple[dict[str, Any], Any]:
    """``program`` compiled as a wheel ships it (frozen, prepacked, weights mapped, packings recorded) and
    loaded as the loader does: the weights file mapped, the int8 weights packed for this CPU."""
    from hatch_aoti.backends import aoti
    from hatch_aoti.loader import packing
    from hatch_aoti.loader.runtime import opened
    from hatch_aoti.loader.weights import mapped

    configs = {**aoti.WHEEL_DEFAULTS, **aoti.FAST_DEFAULTS, **aoti.MAPPED_WEIGHTS}
    entry = aoti.compile_program(program, tmp_path / "out", configs, tmp_path / "work")
    runner = opened(torch, "m", str(tmp_path / "out" / entry["file"]), "cpu", torch.__version__)
    weights = mapped(torch, "m", entry, str(tmp_path / "out"), runner.get_constant_names_to_original_fqns())
    weights.update(packing.packed(torch, "m", packing.chosen(entry), lambda: (weights, None)))
    runner.update_constant_buffer(weights, False, True, True)
    return entry, lambda *args, **kwargs: runner.run([*args, *kwargs.values()])[0]


@pytest.mark.integration  # compiles (about 40 s each on 2 cores)
@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["convolutions", "conv1d"])
def test_the_program_compiles_to_int8_kernels_ships_its_weights_dense_and_matches(kind: str, tmp_path: Path) -> None:
    if kind == "convolutions":
        torch.manual_seed(0)
        model, calibration = Narrow().eval(), [((images(8, seed),), {}) for seed in range(2)]
        example, dynamic = ((images(4, 9),), {}), {"x": {0: Dim("batch", min=1, max=16)}}
        calls = [((images(1, 10),), {}), ((images(16, 11),), {})]
        kernels = {"onednn::qlinear_prepack": 1, "onednn::qconv_prepack": 2}
    else:  # GPT-2's layers, whose int8 weights come from transposed ones
        model, calibration, scale = conv1d_block(), None, torch.tensor(0.5)
        example, dynamic = (
            ((torch.randn(2, 12, 32),), {"scale": scale}),
            {"x": {1: Dim("seq", min=2, max=64)}, "scale": None},
        )
        calls = [((torch.randn(2, seq, 32),), {"scale": scale}) for seq in (2, 64)]
        kernels = {"onednn::qlinear_prepack": 2}  # proj, called twice, runs on its weight dequantized
    # as the build quantizes: without VNNI, whose full-range products saturate, in 7 bits
    program, _ = int8_program(model, *example, dynamic, calibration, reduce_range=not has_vnni())
    register_lowering()  # done by int8_program already: a second call changes nothing
    entry, compiled = compiled_as_shipped(program, tmp_path / kind)  # a path no loaded library had
    recorded = [how["op"] for how in entry["packing"].values()]
    assert {op: recorded.count(op) for op in set(recorded)} == kernels, entry["packing"]
    assert any(t["dtype"] == "int8" for t in entry["weights"]["tensors"].values()), "int8 weights mapped, dense"
    tensors = [a for how in entry["packing"].values() for a in how["args"] if isinstance(a, dict)]
    if kind == "convolutions":  # the narrow one's weight scales are in the library's code: recorded by value
        assert any("values" in a for a in tensors), entry["packing"]
    with torch.no_grad():
        for args, kwargs in calls:
            expected = model(*args, **kwargs)
            assert_close(compiled(*args, **kwargs), expected)
            assert_close(compiled(*args, **kwargs), program.module()(*args, **kwargs))


def test_a_saved_program_loads_where_the_lowering_is_registered(tmp_path: Path) -> None:
    """A compile helper loads the programs the coordinator saved: without torchao's ops it cannot."""
    model, x = mlp(), torch.randn(4, 32)
    program, _ = int8_program(model, (x,), {}, None, None)
    torch.export.save(program, tmp_path / "int8.pt2")
    torch.save(x, tmp_path / "x.pt")
    script = """if 1:
        import sys, torch
        from hatch_aoti.worker.int8 import register_lowering
        register_lowering()
        program = torch.export.load(sys.argv[1] + "/int8.pt2")
        torch.save(program.module()(torch.load(sys.argv[1] + "/x.pt")), sys.argv[1] + "/y.pt")
    """
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, capture_output=True)
    assert torch.equal(torch.load(tmp_path / "y.pt"), program.module()(x))


def test_without_torchao_the_error_says_to_add_it_to_the_build_requirements(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in sys.modules if name == "torchao" or name.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ImportError, match="add `torchao` to `build-system.requires`") as caught:
        int8_program(mlp(), (torch.randn(2, 32),), {}, None, None)
    assert str(caught.value) == INSTALL


class Pooled(nn.Module):
    """BERT's shape: a pooler (a linear layer and a tanh) whose output the caller does not return."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.pooler, self.activation = nn.Linear(16, 16), nn.Linear(16, 16), nn.Tanh()

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = self.body(x)
        self.activation(self.pooler(h[:, 0]))  # computed, then dropped
        return h


def test_a_layer_whose_output_nothing_reads_is_left_out_not_an_error() -> None:
    torch.manual_seed(0)
    model, x = Pooled().eval(), torch.randn(2, 4, 16)
    program, quantized = int8_program(model, (x,), {}, None, None)
    assert quantized.linear == (1, 1)
    assert_close(program.module()(x), model(x))


def test_activations_take_the_full_uint8_range_or_7_bits_where_asked() -> None:
    """The loader runs int8 only where VNNI multiplies full-range activations without saturating; a build
    machine without VNNI verifies a variant in 7 bits, which every CPU multiplies exactly."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64)).eval(), torch.randn(8, 64)

    def ranges(**keys: Any) -> set[Any]:
        program = int8_program(model, (x,), {}, None, None, **keys)[0]
        return {n.args[1:3] for n in program.graph.nodes if "choose_qparams" in str(n.target)}

    assert ranges() == {(0, 255)}
    assert ranges(reduce_range=True) == {(0, 127)}
