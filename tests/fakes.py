"""Fake build processes that speak hatch-aoti's protocols without torch: `python fakes.py ROLE JOB`.

- ``helper``: for each task, does what ``job["script"][model]`` says: ``ok`` (reports a
  compiled model), ``fail`` (reports a failure), ``die`` (SIGKILLs itself before reporting).
- ``coordinator``: emits ``job["events"]`` in order, then ends as ``job["end"]`` says
  (``exit`` or ``die``).
- ``sleeper``: starts a grandchild that sleeps (a stand-in for a compiler), reports both
  pids, and sleeps until its parent goes away.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hatch_aoti.build.children import Parent


def helper(job: dict, parent: Parent) -> int:
    for task in job["tasks"]:
        what = job["script"][task["model"]]
        if what == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "fail":
            parent.emit("failed", model=task["model"], error="AOTInductor failed: RuntimeError: boom")
            continue
        Path(task["out"]).mkdir(parents=True, exist_ok=True)
        parent.emit("compiled", model=task["model"], files={"file": "x.so"}, seconds=0.1)
    return 0


def coordinator(job: dict, parent: Parent) -> int:
    for event in job["events"]:
        parent.emit(**event)
    if job.get("end") == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def sleeper(job: dict, parent: Parent) -> int:
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    parent.emit("pids", child=os.getpid(), grandchild=grandchild.pid)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    role, job_file = sys.argv[1], sys.argv[2]
    parent = Parent()
    code = {"helper": helper, "coordinator": coordinator, "sleeper": sleeper}[role](
        json.loads(Path(job_file).read_text()), parent
    )
    parent.close()
    sys.exit(code)
