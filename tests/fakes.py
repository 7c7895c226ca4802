"""Fake build processes that speak hatch-aoti's protocols without torch: `python fakes.py ROLE JOB`.

What each does comes from the ``HATCH_AOTI_FAKE`` environment variable (JSON), since the job
file is the real, typed one:
- ``helper``: for each task, does what ``script[model]`` says: ``ok`` (reports a compiled
  model), ``big`` (the same, with files described in more bytes than a pipe holds), ``fail``
  (reports a failure), ``die`` (SIGKILLs itself before reporting).
- ``coordinator``: emits ``events`` in order, sleeps ``sleep`` seconds, then ends as ``end`` says
  (``exit`` or ``die``).
- ``sleeper``: starts a grandchild that sleeps (a stand-in for a compiler), reports both
  pids (as an ``info`` event), and sleeps until its parent goes away.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hatch_aoti.pipeline import protocol
from hatch_aoti.pipeline.children import Parent, exit_without_teardown


def helper(fake: dict, parent: Parent) -> int:
    job = protocol.read_job(protocol.HelperJob, Path(sys.argv[2]))
    for task in job.tasks:
        what = fake["script"][task.model]
        if what == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "fail":
            parent.emit(protocol.Failed(task.model, "compile", "AOTInductor failed: RuntimeError: boom"))
            continue
        Path(task.out).mkdir(parents=True, exist_ok=True)
        files = {"file": "x.so", "index": "w" * 256 * 1024} if what == "big" else {"file": "x.so"}
        parent.emit(protocol.Compiled(task.model, 0.1, files))
    return 0


def coordinator(fake: dict, parent: Parent) -> int:
    protocol.read_job(protocol.Job, Path(sys.argv[2]))
    for event in fake["events"]:
        parent.emit(protocol.decode(json.dumps(event)))
    time.sleep(fake.get("sleep", 0))
    if fake.get("end") == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if fake.get("end") == "linger":  # a process the factory started, holding the event pipe open
        held = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], close_fds=False)
        Path(fake["pidfile"]).write_text(str(held.pid))
    return 0


def sleeper(fake: dict, parent: Parent) -> int:
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    parent.emit(protocol.Info(json.dumps({"child": os.getpid(), "grandchild": grandchild.pid})))
    time.sleep(600)
    return 0


if __name__ == "__main__":
    role = sys.argv[1]
    parent = Parent()
    fake = json.loads(os.environ.get("HATCH_AOTI_FAKE", "{}"))
    code = {"helper": helper, "coordinator": coordinator, "sleeper": sleeper}[role](fake, parent)
    parent.close()
    exit_without_teardown(code)  # as real children end
