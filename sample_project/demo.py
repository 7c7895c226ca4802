"""Run the compiled sample models next to their eager versions.

Run it with an installed sample-models wheel: it prints outputs and latencies.
"""

from __future__ import annotations

import time

import torch
from sample_models import compiled
from sample_models.models import build_classifier, build_mlp


def latency_us(fn, *args, repeat: int = 5, number: int = 2000) -> float:
    """Best of ``repeat`` runs of ``number`` calls, in microseconds per call."""
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(number):
                fn(*args)
            best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def main() -> None:
    print("compiled models:", compiled.names())
    torch.manual_seed(0)
    cases = {
        "mlp": (build_mlp(), (torch.randn(4, 128),)),
        "classifier": (build_classifier(), (torch.rand(7, 3, 16, 16),)),
    }
    for name, (eager, args) in cases.items():
        model = compiled.load(name)
        with torch.inference_mode():
            out, ref = model(*args), eager(*args)
        first = out if isinstance(out, torch.Tensor) else out[0]
        first_ref = ref if isinstance(ref, torch.Tensor) else ref[0]
        meta = compiled.info(name)
        print(f"\n{name}: built with torch {meta['torch']} for {meta['device']}, dynamic dims {meta['dynamic']}")
        print(
            f"  input shapes {[list(a.shape) for a in args]} -> compiled output[0] row 0: "
            f"{[round(v, 4) for v in first[0].tolist()]}"
        )
        print(f"  max |compiled - eager| = {(first - first_ref).abs().max().item():.2e}")
        t_eager, t_compiled = latency_us(eager, *args), latency_us(model, *args)
        print(f"  latency: eager {t_eager:.1f} us, compiled {t_compiled:.1f} us ({t_eager / t_compiled:.2f}x faster)")


if __name__ == "__main__":
    main()
