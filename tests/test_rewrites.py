"""The exact rewrites the aoti backend makes to an exported program before Inductor compiles it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hatch_aoti.backends.rewrites import whole_window_pools

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
