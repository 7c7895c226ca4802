"""What each ``HATCH_AOTI_PACK`` choice gives: the same wheel loaded three ways, side by side.

Builds the real-size models of ``benchmarks/peers.py`` into one wheel with the defaults, then in
one process loads each model with ``HATCH_AOTI_PACK`` set to ``convolutions`` (the default),
``all`` and ``none`` and times the three and the eager model in interleaved rounds. Each choice's
load and first call, and the anonymous memory it adds, are taken in fresh processes.
Run with the test venv (and the ``bench`` extra):

    .venv-test/bin/python benchmarks/packing.py --models bert,gpt2,resnet50,vit --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import peers
from common import cpu_name, run_child, timed

CHOICES = ("convolutions", "all", "none")


def fresh(site: Path, name: str, choice: str, threads: int) -> dict[str, float]:
    """Load and first call of one model under one choice, in a fresh process, and the memory they add."""
    env = {**os.environ, "HATCH_AOTI_PACK": choice}
    out = run_child(
        "packing_fresh", site, name, threads, env=env, failure=f"{name} with HATCH_AOTI_PACK={choice} failed"
    )
    found: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return found


def side_by_side(name: str, threads: int, rounds: int) -> dict[str, float]:
    """Each choice's median time per call (s), and eager's, loaded in this process."""
    import torch
    from peerpkg import compiled
    from peerpkg import models as eager_models

    x, module = peers.example(name), getattr(eager_models, name)()
    calls: dict[str, Callable[[], object]] = {}
    for choice in CHOICES:
        os.environ["HATCH_AOTI_PACK"] = choice
        compiled._LOADED.pop(name, None)  # loaded again, under this choice
        model = compiled.load(name)
        with torch.no_grad():
            torch.testing.assert_close(model(x), module(x), rtol=1e-3, atol=1e-3)
        calls[choice] = lambda model=model: model(x)  # type: ignore[misc]
    os.environ.pop("HATCH_AOTI_PACK")
    calls["eager"] = lambda: module(x)
    return timed(calls, threads, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(peers.INPUTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    models = args.models.split(",")
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; {args.threads} thread(s)")
    with tempfile.TemporaryDirectory(prefix="hatch-aoti-packing-") as tmp:
        site, seconds, _ = peers.build(models, False, "portable", None, Path(tmp))
        print(f"built {len(models)} models in {seconds:.0f} s")
        sys.path.insert(0, str(site))
        for name in models:
            from peerpkg import compiled

            recorded = [how["op"].split("::_reorder_")[-1] for how in compiled.info(name).get("packing", {}).values()]
            kinds = ", ".join(f"{recorded.count(k)} {k}" for k in sorted(set(recorded))) or "none"
            medians = side_by_side(name, args.threads, args.rounds)
            times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items())
            print(f"{name}: packings recorded: {kinds}\n  {times}")
            print(f"  default time / all time: {medians['convolutions'] / medians['all']:.2f}")
            for choice in CHOICES[:2]:
                load = fresh(site, name, choice, args.threads)
                print(
                    f"  {choice}: load and first call {load['seconds']:.2f} s, anonymous memory "
                    f"+{load['anon_mib']:.0f} MiB, file-backed +{load['file_mib']:.0f} MiB"
                )


if __name__ == "__main__":
    main()
