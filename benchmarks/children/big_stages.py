"""The build's coordinator on a job, as a build runs it, writing a line for each of its events: the
event, its stage, the RSS then and the peak RSS since the previous event (run by benchmarks/big.py).

Usage: ``big_stages.py JOB EVENTS``.
"""

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
import common

from hatch_aoti.pipeline import children, protocol
from hatch_aoti.worker import coordinator

peak = common.PeakRss()
log = open(sys.argv[2], "w")
emit = children.Parent.emit


def logged(self: children.Parent, event: protocol.Event) -> None:
    kind = type(event).__name__.lower()
    log.write(json.dumps([kind, getattr(event, "stage", None), common.rss(), peak.peak]) + "\n")
    log.flush()
    peak.reset()
    emit(self, event)


children.Parent.emit = logged  # type: ignore[method-assign]
sys.argv = sys.argv[:2]
children.child_main(coordinator.run, protocol.Job)
