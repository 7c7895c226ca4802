"""Calls per second of one compiled model from one caller thread and from two, next to its eager model.

Each caller runs at one intra-op thread (`torch.set_num_threads(1)`) for a few seconds; the
ratio two / one is what a server with several worker threads gets. Run it on an installed
(or unpacked) wheel, with the test venv:

    .venv-test/bin/python benchmarks/callers.py SITE PACKAGE MODEL
    HATCH_AOTI_INSTANCES=1 .venv-test/bin/python benchmarks/callers.py SITE PACKAGE MODEL

The eager model comes from the model's factory (`info()["factory"]`), so SITE must hold the
package's sources too, as a wheel does; the input is made from the model's recorded call.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
import time
from typing import Any


def rate(call: Any, callers: int, seconds: float = 4.0) -> float:
    import torch

    stop, counts = time.monotonic() + seconds, [0] * callers

    def work(index: int) -> None:
        with torch.inference_mode():
            while time.monotonic() < stop:
                call()
                counts[index] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(callers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def example(leaf: dict[str, Any]) -> Any:
    import torch

    shape = [d if isinstance(d, int) else d["min"] or 1 for d in leaf["shape"]]
    dtype = getattr(torch, leaf["dtype"])
    if dtype.is_floating_point:
        return torch.rand(shape, dtype=dtype)
    return torch.randint(0, int(leaf.get("high") or 100), shape, dtype=dtype)


def main() -> None:
    site, package, name = sys.argv[1:4]
    sys.path.insert(0, site)
    import torch

    torch.set_num_threads(1)
    compiled = importlib.import_module(f"{package}.compiled")
    info = compiled.info(name)
    inputs = [example(leaf) for leaf in info["call"] if "const" not in leaf]
    model = compiled.load(name)
    eager = pkgutil.resolve_name(info["factory"])().eval()
    for label, call in (("eager", lambda: eager(*inputs)), ("compiled", lambda: model(*inputs))):
        one, two = rate(call, 1), rate(call, 2)
        print(f"{label:9s} one caller {one:.1f}/s, two callers {two:.1f}/s, ratio {two / one:.2f}x", flush=True)


if __name__ == "__main__":
    main()
