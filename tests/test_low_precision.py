"""bfloat16 and float16 outputs, and float32 ones outside the tolerances, are checked against a float64 run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hatch_aoti.worker.verify import Comparison, compare, needs_reference, reference


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = torch.nn.functional.gelu(self.a(x)).to(x.dtype)  # a cast down, as models do
        return self.b(h) + torch.ones(64, dtype=torch.bfloat16)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net().to(torch.bfloat16).eval()


def test_the_float64_run_widens_inputs_weights_and_casts_without_copying_the_model() -> None:
    model, x = net(), torch.randn(8, 64, dtype=torch.bfloat16)
    wide = reference(model, (x,), {})
    assert wide.dtype is torch.float64
    assert all(p.dtype is torch.bfloat16 for p in model.parameters()), "the model itself is untouched"
    exact = Net().eval()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()}, assign=True)
    with torch.no_grad():
        expected = exact.double()(x.double())
    torch.testing.assert_close(wide, expected, rtol=1e-12, atol=1e-12)


class Vocabulary(torch.nn.Module):
    """An embedding and an output layer over a vocabulary, as a language model has."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4096, 64)
        self.out, self.tied = torch.nn.Linear(64, 4096), torch.nn.Linear(64, 4096, bias=False)

    def forward(self, ids):  # type: ignore[no-untyped-def]
        h = self.embed(ids)
        return self.out(h) + torch.nn.functional.linear(h, self.tied.weight), self.out(h[0])


def test_the_float64_run_widens_a_large_weight_a_block_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from hatch_aoti.worker.verify import Float64

    torch.manual_seed(0)
    model, ids = Vocabulary().to(torch.bfloat16).eval(), torch.randint(0, 4096, (2, 5))
    whole = reference(model, (ids,), {})
    widened: list[int] = []
    to = torch.Tensor.to

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = to(self, *args, **kwargs)
        if out.dtype is torch.float64 and out is not self:
            widened.append(out.numel())
        return out

    monkeypatch.setattr(Float64, "BLOCK", 8 * 64 * 512, raising=False)  # 512 rows of 64 in float64
    monkeypatch.setattr(torch.Tensor, "to", counted)
    blockwise = reference(model, (ids,), {})
    assert max(widened) <= 64 * 512, "no weight of 4096 x 64 is widened whole"
    for a, b in zip(whole, blockwise):
        assert b.dtype is torch.float64
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_a_compiled_output_as_close_as_eager_passes_and_a_further_one_fails() -> None:
    model, x = net(), torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
    assert needs_reference(eager, None, None)
    wide = reference(model, (x,), {})
    assert isinstance(wide, torch.Tensor)
    assert not compare("c", eager, eager.clone(), None, None, reference=lambda: wide).problems
    worse = (eager.double() + 0.05 * eager.double().std() * torch.randn(eager.shape)).to(torch.bfloat16)
    (problem,) = compare("c", eager, worse, None, None, reference=lambda: wide).problems
    assert problem.startswith("output: further from a float64 run than eager is (RMS error ")
    # tolerances given: eager alone is the measure, as for any dtype
    assert not needs_reference(eager, 1e-2, 1e-2)
    assert isinstance(compare("c", eager, worse, 1e-2, 1e-2), Comparison)


class Indexed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(10, 16)

    def forward(self, x):  # type: ignore[no-untyped-def]
        index = (x * 10).to(torch.int64).clamp(0, 9)  # a cast to an integer dtype is done, not skipped
        return self.table(index).sum(1).to(x.dtype)


def test_casts_to_integers_and_devices_still_happen_in_the_float64_run() -> None:
    torch.manual_seed(1)
    model, x = Indexed().to(torch.bfloat16).eval(), torch.rand(4, 3, dtype=torch.bfloat16)
    wide = reference(model, (x,), {})
    assert wide is not None and wide.dtype is torch.float64 and wide.shape == (4, 16)


def test_an_infinite_eager_value_does_not_let_a_wrong_output_pass() -> None:
    model, x = net(), torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
    wide = reference(model, (x,), {})
    eager[0, 0] = float("inf")
    assert not compare("c", eager, eager.clone(), None, None, reference=lambda: wide).problems
    (problem,) = compare("c", eager, eager * 2, None, None, reference=lambda: wide).problems
    assert "further from a float64 run than eager is" in problem


def noisy(exact: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (exact + std * torch.randn(exact.shape, generator=generator, dtype=torch.float64)).float()


def test_a_float32_output_outside_the_tolerances_is_judged_by_a_float64_run() -> None:
    # as a deep network's: errors of the output's overall size, so elements near zero fail any rtol
    exact = 50 * torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eager, close, wrong = noisy(exact, 4e-5, 1), noisy(exact, 6e-5, 2), noisy(exact, 5e-3, 3)
    calls: list[int] = []

    def run() -> torch.Tensor:
        calls.append(1)
        return exact

    assert not torch.allclose(close, eager, rtol=1e-4, atol=1e-5)
    found = compare("c", {"y": eager}, {"y": close}, None, None, reference=run)
    assert not found.problems and found.float64_checked
    (problem,) = compare("c", {"y": eager}, {"y": wrong}, None, None, reference=run).problems
    assert problem.startswith("output['y']: values differ beyond rtol=0.0001, atol=1e-05 (max abs err ")
    assert "; further from a float64 run than eager is (RMS error " in problem
    assert "1e-05x the output's RMS" in problem
    # a few wrong elements barely move an RMS: the worst element is bounded too
    spike = close.clone()
    spike[7] += 0.02  # 4e-4 of the RMS: within the RMS bound, not within the largest error's
    (problem,) = compare("c", eager, spike, None, None, reference=run).problems
    assert "further from a float64 run than eager is (largest error " in problem
    # NaN or Inf where eager has other values are not judged by the float64 run
    for bad in (float("nan"), float("inf")):
        broken = close.clone()
        broken[3] = bad
        assert compare("c", eager, broken, None, None, reference=run).problems
    # a random model's eager result is far from its float64 run: the run cannot judge it
    (problem,) = compare("c", eager, close, None, None, reference=lambda: noisy(exact, 1.0, 4).double()).problems
    assert "; a float64 run cannot judge it: eager itself is " in problem
    # within the tolerances, no float64 run is made; with tolerances given, none is consulted
    calls.clear()
    assert not compare("c", eager, eager.clone(), None, None, reference=run).problems and not calls
    assert compare("c", eager, close, 1e-4, 1e-5, reference=run).problems and not calls
