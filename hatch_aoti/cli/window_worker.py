"""Run by ``hatch-aoti verify --torch`` in an environment made for one torch release (torch and the wheel,
with hatch-aoti's own modules on the path): one model of the installed package against eager.

Prints one JSON document: the torch found, and the model's status (``pass``, ``mismatch``,
``fails to load``, ``fails``, ``skipped``) with the reason.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from typing import Any

PRECOMPILED = "precompiled models load only under the exact torch and Python that built them: not tried"


def check(loader: Any, name: str) -> dict[str, Any]:
    from hatch_aoti.cli import calls

    entry = loader.info(name)
    if entry.get("backend") == "precompile":
        return {"status": "skipped", "reason": PRECOMPILED}
    try:
        model = loader.load(name)
    except Exception as exc:
        return {"status": "fails to load", "reason": f"{type(exc).__name__}: {calls.first_line(exc)}"}
    try:
        module = pkgutil.resolve_name(entry["factory"])().to(entry["device"]).eval()
    except Exception as exc:
        return {"status": "fails", "reason": f"the eager model: {type(exc).__name__}: {calls.first_line(exc)}"}
    cases, reason = calls.run_cases(entry, model, module)
    return {"status": "mismatch" if reason else "pass", "reason": reason, "cases": cases}


def main(package: str, loader_name: str, name: str) -> None:
    import torch

    loader = importlib.import_module(f"{package}.{loader_name}")
    print(json.dumps({"torch": torch.__version__, **check(loader, name)}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
