"""SmoothQuant for an int8 variant's linear layers (Xiao et al., 2023), with torchao's observer.

Activations quantized per call take one scale for the whole tensor, so a few input channels far
larger than the rest cost every other channel its precision. Each linear layer's input is divided by
a factor per input channel and its weight multiplied by it: the same product in exact arithmetic,
with the activations' range evened out and part of it moved into the weights, which are quantized
per output channel. The factors, ``max|x_j|^alpha / max|W_j|^(1 - alpha)``, come from torchao's
``RunningAbsMaxSmoothQuantObserver`` on the samples the variant is calibrated on (the example
inputs where there are none); ``alpha = 0.5`` is the paper's and torchao's default
(docs/configuration.md#precision says what it measured).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hatch_aoti.worker.structural import replaced

ALPHA = 0.5


def smoothed(
    module: torch.nn.Module, samples: list[tuple[tuple[Any, ...], dict[str, Any]]], alpha: float = ALPHA
) -> tuple[torch.nn.Module, int]:
    """``module`` with each float32 ``nn.Linear`` that the samples reach smoothed, and how many were: a
    structural copy whose smoothed layers are new ``nn.Linear`` modules (so the quantizer takes them as
    linear layers) with weights of their own; the module itself is left as it was."""
    try:
        from torchao.prototype.smoothquant.core import RunningAbsMaxSmoothQuantObserver
    except ImportError as exc:
        raise ImportError(
            f"int8 precision smooths linear layers with torchao's SmoothQuant observer, which the installed "
            f"torchao lacks ({exc}): require `torchao>=0.18` in `build-system.requires`",
            name="torchao",
        ) from exc

    layers = {id(m): m for m in module.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32}
    observers = {key: RunningAbsMaxSmoothQuantObserver(m.weight.detach(), alpha=alpha) for key, m in layers.items()}
    hooks = [layers[key].register_forward_pre_hook(_observing(obs)) for key, obs in observers.items()]
    try:
        with torch.no_grad():
            for args, kwargs in samples:
                module(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    swaps: dict[int, torch.nn.Module] = {}
    for key, observer in observers.items():
        if not observer.calibration_count:  # no sample reached it
            continue
        # a channel the samples left near zero would be amplified by its factor, and on an input where it
        # is not, would take the whole tensor's range: none counts as smaller than the layer's median
        observer.x_abs_max = observer.x_abs_max.clamp(min=observer.x_abs_max.median())
        factor = observer.compute_smoothing_factor()
        if bool(torch.isfinite(factor).all()) and bool((factor > 0).all()):
            swaps[key] = _smoothed_linear(layers[key], factor)
    return replaced(module, swaps), len(swaps)


def _observing(observer: Any) -> Callable[..., None]:
    def hook(layer: torch.nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.ndim >= 1 and x.numel():
            observer(x.detach().reshape(-1, x.shape[-1]).float())

    return hook


def _smoothed_linear(layer: torch.nn.Linear, factor: torch.Tensor) -> torch.nn.Linear:
    """``x -> layer(x)`` as ``(x / factor) @ (weight * factor).T + bias``: a new ``nn.Linear`` (its forward
    divides its input first), the bias shared."""
    smooth = torch.nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
    smooth.weight = torch.nn.Parameter(layer.weight.detach() * factor, requires_grad=False)
    smooth.bias = layer.bias
    inverse = (1.0 / factor).to(layer.weight.dtype)
    smooth.register_buffer("smoothing", inverse)
    linear = type(smooth).forward.__get__(smooth)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x * smooth.get_buffer("smoothing"))

    smooth.forward = forward  # type: ignore[method-assign,assignment]
    return smooth
