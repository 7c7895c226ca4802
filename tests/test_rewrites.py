"""The exact rewrites the aoti backend makes to an exported program before Inductor compiles it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hatch_aoti.backends.rewrites import whole_window_pools, zero_pads_into_convolutions

MEAN = torch.ops.aten.mean.dim


def exported(module: nn.Module, shape: list[int], dynamic: dict[int, object] | None = None) -> object:
    return torch.export.export(module.eval(), (torch.rand(shape),), dynamic_shapes=({**dynamic},) if dynamic else None)


def targets(program: object) -> list[object]:
    return [n.target for n in program.graph.nodes if n.op == "call_function"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("module", "shape"),
    [
        (nn.AvgPool2d(2560, ceil_mode=True), [1, 6, 7, 7]),  # transformers' EfficientNet pooler
        (nn.AvgPool2d(64, ceil_mode=True, count_include_pad=False), [2, 3, 5, 9]),
        (nn.AvgPool2d((5, 9)), [1, 3, 5, 9]),  # the kernel is the input's size
        (nn.AvgPool2d((5, 12), stride=(1, 20), ceil_mode=True), [1, 3, 5, 9]),
        (nn.AvgPool1d(100, ceil_mode=True), [2, 4, 30]),
        (nn.AvgPool3d((3, 4, 5)), [1, 2, 3, 4, 5]),
    ],
)
def test_a_pool_whose_window_covers_its_input_becomes_the_mean_eager_computes(module: nn.Module, shape: list[int]):
    program = exported(module, shape)
    x = torch.randn(shape)
    assert whole_window_pools(program) == 1
    assert targets(program) == [MEAN]
    got = program.module()(x)  # type: ignore[attr-defined]
    torch.testing.assert_close(got, module(x), rtol=1e-6, atol=1e-6)
    assert got.shape == module(x).shape
    assert whole_window_pools(program) == 0  # nothing left to turn: a second compile of it is the same
    (node,) = [n for n in program.graph.nodes if n.target is MEAN]  # type: ignore[attr-defined]
    assert node.meta["val"].shape == got.shape and node.meta["val"].stride() == got.stride()


@pytest.mark.parametrize(
    ("module", "shape", "why"),
    [
        (nn.AvgPool2d(3), [1, 3, 9, 9], "several windows"),
        (nn.AvgPool2d(64, ceil_mode=True, padding=1), [1, 3, 7, 7], "padding"),
        (nn.AvgPool2d(64, ceil_mode=True, divisor_override=3), [1, 3, 7, 7], "a divisor given"),
        (nn.AvgPool2d((7, 2), ceil_mode=True), [1, 3, 7, 7], "covers one dim only"),
        (nn.AvgPool2d(4), [1, 3, 7, 7], "one window that leaves the input's last rows and columns out"),
    ],
)
def test_other_pools_stay_as_they_are(module: nn.Module, shape: list[int], why: str):
    program = exported(module, shape)
    before = targets(program)
    assert whole_window_pools(program) == 0, why
    assert targets(program) == before


def test_the_mean_of_a_channels_last_input_is_traced_with_its_own_strides():
    x = torch.rand(2, 8, 5, 5).to(memory_format=torch.channels_last)
    program = torch.export.export(nn.AvgPool2d(64, ceil_mode=True), (x,))
    assert whole_window_pools(program) == 1
    (node,) = [n for n in program.graph.nodes if n.target is MEAN]
    got = program.module()(x)
    assert node.meta["val"].stride() == got.stride() and node.meta["tensor_meta"].stride == got.stride()


def test_an_op_of_another_library_named_like_a_pool_stays_as_it_is():
    @torch.library.custom_op("rewrites_test::avg_pool2d", mutates_args=())
    def pool(x: torch.Tensor, kernel: int) -> torch.Tensor:
        return x.sum((-2, -1), keepdim=True)

    pool.register_fake(lambda x, kernel: x.sum((-2, -1), keepdim=True))

    class Library(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.rewrites_test.avg_pool2d(x, 64)

    program = exported(Library(), [1, 3, 7, 7])
    assert whole_window_pools(program) == 0


def test_an_integer_pool_stays_as_it_is():
    """Eager rounds an integer pool, and ``mean`` refuses integers."""

    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.avg_pool2d(x, 64, ceil_mode=True)

    x = torch.randint(0, 10, (1, 3, 7, 7))
    program = torch.export.export(Pool(), (x,))
    assert whole_window_pools(program) == 0
    assert torch.equal(program.module()(x), Pool()(x))


def test_a_pool_in_a_subgraph_is_turned_too():
    class Branches(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pool = nn.functional.avg_pool2d
            whole, peak = (lambda t: pool(t, 64, ceil_mode=True)), (lambda t: -t.amax((-2, -1), True))
            return torch.cond(x.sum() > 0, whole, peak, (x,))

    program = exported(Branches(), [1, 3, 7, 7])
    x = torch.rand(1, 3, 7, 7)
    assert whole_window_pools(program) == 1
    assert MEAN in targets(program.graph_module.true_graph_0)  # type: ignore[attr-defined]
    torch.testing.assert_close(program.module()(x), Branches()(x), rtol=1e-6, atol=1e-6)  # type: ignore[attr-defined]


def test_a_pool_over_a_dynamic_size_stays_as_it_is():
    """The rewrite reads only static sizes: it does not reason over a size's range."""
    program = exported(nn.AvgPool2d(64, ceil_mode=True), [1, 3, 7, 7], {3: torch.export.Dim("w", min=2, max=64)})
    assert whole_window_pools(program) == 0


def test_the_rewritten_node_keeps_its_name_so_recorded_outputs_still_find_it():
    program = exported(nn.Sequential(nn.ReLU(), nn.AvgPool2d(100, ceil_mode=True)), [1, 3, 7, 7])
    (output,) = program.graph_signature.user_outputs  # type: ignore[attr-defined]
    whole_window_pools(program)
    assert program.graph_signature.user_outputs == (output,)  # type: ignore[attr-defined]
    assert [n.name for n in program.graph.nodes if n.target is MEAN] == [output]  # type: ignore[attr-defined]


CONVOLUTIONS = {torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default}
PADS = {torch.ops.aten.pad.default, torch.ops.aten.constant_pad_nd.default}


class PadThenConv(nn.Module):
    def __init__(self, conv: nn.Module, sides: list[int], **pad: object) -> None:
        super().__init__()
        self.conv, self.sides, self.pad = conv, sides, pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(nn.functional.pad(x, self.sides, **self.pad))  # type: ignore[arg-type]


def convolution_paddings(program: object) -> list[list[int]]:
    nodes = program.graph.nodes  # type: ignore[attr-defined]
    found = [n for n in nodes if n.target in CONVOLUTIONS or n.target is torch.ops.aten.convolution.default]
    return [list(n.args[4]) for n in found]


@pytest.mark.parametrize(
    ("conv", "sides", "shape", "padding"),
    [
        (nn.Conv2d(8, 8, 3, groups=8), [1, 1, 1, 1], [1, 8, 14, 14], [1, 1]),  # MobileNetV2's depthwise
        (nn.Conv2d(3, 4, 3, padding=1), [2, 2, 1, 1], [1, 3, 9, 9], [2, 3]),  # adds to its own padding
        (nn.Conv2d(3, 4, 5, stride=2, dilation=2), [0, 0, 3, 3], [2, 3, 17, 17], [3, 0]),
        (nn.Conv1d(4, 6, 3, bias=False), [1, 1], [2, 4, 20], [1]),
        (nn.Conv3d(2, 3, 3), [1, 1, 2, 2, 1, 1], [1, 2, 6, 7, 8], [1, 2, 1]),
        (nn.Conv2d(3, 4, 3), [1, 1], [3, 9, 9], [0, 1]),  # no batch dim
    ],
)
@pytest.mark.parametrize("decomposed", [False, True], ids=["aten", "core-aten"])
def test_an_even_zero_pad_folds_into_the_convolution_that_reads_it(
    conv: nn.Module, sides: list[int], shape: list[int], padding: list[int], decomposed: bool
):
    if decomposed and len(shape) == len(padding) + 1:
        pytest.skip("core aten gives an unbatched convolution a batch dim of its own, between it and the pad")
    model = PadThenConv(conv, sides)
    program = exported(model, shape)
    if decomposed:  # constant_pad_nd into aten.convolution, as run_decompositions gives them
        program = program.run_decompositions()  # type: ignore[attr-defined]
    x = torch.randn(shape)
    assert zero_pads_into_convolutions(program) == 1
    assert not PADS & set(targets(program))
    assert convolution_paddings(program) == [padding]
    got = program.module()(x)  # type: ignore[attr-defined]
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    (node,) = [n for n in program.graph.nodes if n.name == program.graph_signature.user_outputs[0]]  # type: ignore[attr-defined]
    assert node.meta["val"].shape == got.shape
    assert zero_pads_into_convolutions(program) == 0


@pytest.mark.parametrize(
    ("model", "shape", "why"),
    [
        (PadThenConv(nn.Conv2d(3, 4, 3, stride=2), [0, 1, 0, 1]), [1, 3, 8, 8], "more after than before"),
        (PadThenConv(nn.Conv2d(3, 4, 3), [1, 1, 1, 1], value=1.0), [1, 3, 8, 8], "pads with ones"),
        (PadThenConv(nn.Conv2d(3, 4, 3), [1, 1, 1, 1], mode="reflect"), [1, 3, 8, 8], "reflects"),
        (PadThenConv(nn.Conv2d(5, 4, 3), [1, 1, 1, 1, 1, 1]), [1, 3, 8, 8], "pads the channels"),
        (PadThenConv(nn.Conv2d(3, 4, 3), [-1, -1, 0, 0]), [1, 3, 8, 8], "crops"),
        (PadThenConv(nn.ConvTranspose2d(3, 4, 3), [1, 1, 1, 1]), [1, 3, 8, 8], "a transposed convolution"),
        (PadThenConv(nn.Conv2d(3, 4, 3, padding="same"), [1, 1, 1, 1]), [1, 3, 8, 8], "padding by name"),
    ],
)
@pytest.mark.parametrize("decomposed", [False, True], ids=["aten", "core-aten"])
def test_other_pads_stay_as_they_are(model: nn.Module, shape: list[int], why: str, decomposed: bool):
    if decomposed and why == "padding by name":
        pytest.skip("core aten gives the padding as numbers, and the pad then folds into it")
    program = exported(model, shape)
    if decomposed:  # a transposed convolution is aten.convolution with transposed=True
        program = program.run_decompositions()  # type: ignore[attr-defined]
    before = targets(program)
    assert zero_pads_into_convolutions(program) == 0, why
    assert targets(program) == before


def test_pads_of_pads_fold_together():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(nn.functional.pad(nn.functional.pad(x, [1, 1, 0, 0]), [2, 2, 1, 1]))

    model, x = Twice(), torch.randn(1, 3, 8, 8)
    program = exported(model, [1, 3, 8, 8])
    assert zero_pads_into_convolutions(program) == 2
    assert not PADS & set(targets(program))
    assert convolution_paddings(program) == [[2, 4]]
    torch.testing.assert_close(program.module()(x), model(x), rtol=1e-5, atol=1e-5)  # type: ignore[attr-defined]


def test_a_pad_that_is_read_elsewhere_too_stays():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            padded = nn.functional.pad(x, [1, 1, 1, 1])
            return self.conv(padded), padded

    program = exported(Shared(), [1, 3, 8, 8])
    assert zero_pads_into_convolutions(program) == 0


def test_a_folded_convolution_of_a_channels_last_input_keeps_eager_strides():
    model = PadThenConv(nn.Conv2d(8, 8, 3, groups=8), [1, 1, 1, 1]).eval()
    x = torch.rand(1, 8, 10, 10).to(memory_format=torch.channels_last)
    program = torch.export.export(model, (x,))
    assert zero_pads_into_convolutions(program) == 1
    (node,) = [n for n in program.graph.nodes if n.target in CONVOLUTIONS]
    got = program.module()(x)
    assert node.meta["val"].stride() == got.stride() == model(x).stride()
    assert node.meta["tensor_meta"].stride == got.stride()
