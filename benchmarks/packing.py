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
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers

CHOICES = ("convolutions", "all", "none")
#: Run in a fresh process per choice: load and first call, and what they add to the process.
FRESH = """
import json, sys, time
sys.path[:0] = [{site!r}, {here!r}]
import torch, peers
torch.set_num_threads({threads})
from peerpkg import compiled

def status():
    lines = open("/proc/self/status").read().splitlines()
    return {{l.split(":")[0]: int(l.split()[1]) for l in lines if l.startswith(("RssAnon", "RssFile"))}}

x = peers.example({name!r})
before, start = status(), time.perf_counter()
compiled.load({name!r})(x)
seconds, after = time.perf_counter() - start, status()
print(json.dumps({{"seconds": seconds, "anon_mib": (after["RssAnon"] - before["RssAnon"]) / 1024,
                   "file_mib": (after["RssFile"] - before["RssFile"]) / 1024}}))
"""


def fresh(site: Path, name: str, choice: str, threads: int) -> dict[str, float]:
    code = FRESH.format(site=str(site), here=str(Path(__file__).resolve().parent), name=name, threads=threads)
    env = {**os.environ, "HATCH_AOTI_PACK": choice}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        sys.exit(f"{name} with HATCH_AOTI_PACK={choice} failed:\n{proc.stderr[-3000:]}")
    found: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def side_by_side(name: str, threads: int, rounds: int) -> dict[str, float]:
    """Each choice's median time per call (s), and eager's, loaded in this process."""
    import torch
    from peerpkg import compiled
    from peerpkg import models as eager_models

    x, module = peers.example(name), getattr(eager_models, name)()
    calls = {}
    for choice in CHOICES:
        os.environ["HATCH_AOTI_PACK"] = choice
        compiled._LOADED.pop(name, None)  # loaded again, under this choice
        model = compiled.load(name)
        with torch.no_grad():
            torch.testing.assert_close(model(x), module(x), rtol=1e-3, atol=1e-3)
        calls[choice] = lambda model=model: model(x)
    os.environ.pop("HATCH_AOTI_PACK")
    calls["eager"] = lambda: module(x)
    return peers.timed(calls, threads, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(peers.INPUTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    models = args.models.split(",")
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU: {peers.cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; {args.threads} thread(s)")
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
