"""Zero pads folded into the convolutions that read them, against the same program compiled as it is.

transformers' MobileNetV2 (default config, 224x224, batch 1, the weights of ``benchmarks/peers.py``)
is exported once, and compiled twice with the ``aoti`` backend's fast defaults (``freezing`` and
``cpp.weight_prepack``), each in a process of its own: once with
``hatch_aoti.backends.rewrites.zero_pads_into_convolutions`` applied, as an ``aoti`` build applies
it, and once without. One process then loads both packages and eager, checks them against eager,
and times them in interleaved rounds with ``torch.utils.benchmark``. Run with the test venv (with
``transformers``):

    .venv-test/bin/python benchmarks/pads.py --rounds 4
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import peers
from common import run_child


def compiled(folded: bool, path: Path) -> str:
    """Compile MobileNetV2 one way into ``path``, in a fresh process; what it folded."""
    out = run_child("pads_compile", "folded" if folded else "as-is", path, failure="the compile failed")
    pads, count = out.split()[-2:]
    return f"{count} of {pads} pads folded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        paths = {"folded": Path(work, "folded.pt2"), "as-is": Path(work, "as-is.pt2")}
        for name, path in paths.items():
            print(f"{name}: {compiled(name == 'folded', path)}", flush=True)
        time_side_by_side(paths, args.rounds, args.threads)


def time_side_by_side(paths: dict[str, Path], rounds: int, threads: int) -> None:
    """Each side's median per round, interleaved, and the ratio of the best medians."""
    import torch
    import torch._inductor
    from torch.utils.benchmark import Timer

    model, x = peers.eager("mobilenetv2"), peers.example("mobilenetv2")  # made as the compiles made them
    torch.set_num_threads(threads)
    calls = {name: torch._inductor.aoti_load_package(str(path)) for name, path in paths.items()}
    calls["eager"] = model
    with torch.no_grad():
        want = model(x)
        for name, call in calls.items():
            torch.testing.assert_close(call(x), want, rtol=1e-3, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[misc]
        best: dict[str, float] = {}
        for round_ in range(rounds):
            for name, call in calls.items():
                timer = Timer("call(x)", globals={"call": call, "x": x}, num_threads=threads)
                ms = timer.blocked_autorange(min_run_time=2).median * 1e3
                best[name] = min(best.get(name, ms), ms)
                print(f"round {round_ + 1}: {name:7} {ms:7.3f} ms", flush=True)
    print("\nbest medians: " + "  ".join(f"{name} {ms:.3f} ms" for name, ms in best.items()))
    print(
        f"as-is / folded: {best['as-is'] / best['folded']:.3f}x  eager / folded: {best['eager'] / best['folded']:.2f}x"
    )


if __name__ == "__main__":
    main()
