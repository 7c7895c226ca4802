"""``hatch-aoti verify``: every shipped file against its recorded digest, then every model loaded and run here.

A model whose files fail their digests is not loaded: a damaged library could crash
the process instead of raising.
"""

from __future__ import annotations

from typing import Any

from hatch_aoti.cli import calls, integrity, machine, models
from hatch_aoti.cli.output import Output
from hatch_aoti.cli.target import Target
from hatch_aoti.loader.schema import precision_of, variants_of


def run(target: Target, out: Output, package_code: bool, eager: bool) -> int:
    files = integrity.check(target)
    results: dict[str, dict[str, Any]] = {}
    with out.progress(len(target.models), "verifying") as step:
        for name in target.models:
            damaged = files.models[name] + [f"not loaded: {p}" for p in files.package]  # a damaged loader or manifest
            results[name] = verify(target, name, damaged, package_code, eager)
            if "external" in target.model(name).get("weights", {}):  # fetched by the load, if it was not cached
                results[name]["weights_source"] = machine.weights_source(target, name)
            step(name)
    statuses = [r["status"] for r in results.values()]
    passed = not files.package and "failed" not in statuses and "ok" in statuses
    data = {
        "target": target.where,
        "passed": passed,
        "files": {"checked": files.checked, "problems": files.package},
        "models": results,
    }
    out.data(data)
    if not out.json:
        show(data, out)
    return 0 if passed else 1


def verify(target: Target, name: str, damaged: list[str], package_code: bool, eager: bool) -> dict[str, Any]:
    """The variant that loads here, and each other one this CPU runs natively (``variants``), each run
    and, with ``eager``, checked as the build checked it."""
    if damaged:
        return {"status": "failed", "reason": "; ".join(damaged), "cases": []}
    found = machine.variants(target, name)
    if found["loads_here"] is None:  # as for a CPU without the model's target features
        reasons = "; ".join(f"{p}: {why}" for p, why in found["passed_over"].items())
        return {"status": "skipped", "reason": f"no variant runs here ({reasons})", "cases": []}
    entry = target.model(name)
    by_precision = {precision_of(v): v for v in variants_of(entry)}
    runs = [found["loads_here"]] + [
        v["precision"] for v in found["variants"] if v["native_here"] and v["precision"] != found["loads_here"]
    ]
    results: dict[str, dict[str, Any]] = {}
    for precision in runs:
        try:
            model = models.compiled(target, name, package_code, precision if len(by_precision) > 1 else None)
            module = models.eager(target, name) if eager else None
        except models.Unavailable as exc:
            results[str(precision)] = {
                "status": "skipped" if exc.skipped else "failed",
                "reason": str(exc),
                "cases": [],
            }
            continue
        tried, reason = calls.run_cases(by_precision.get(str(precision), entry), model, module)
        results[str(precision)] = {"status": "failed" if reason else "ok", "reason": reason, "cases": tried}
    first = next(iter(results.values()))
    if len(results) == 1 and len(by_precision) == 1:
        return first
    failed = {p: r for p, r in results.items() if r["status"] == "failed"}
    reason = "; ".join(f"{p}: {r['reason']}" for p, r in failed.items())
    status = "failed" if failed else first["status"]
    return {
        "status": status,
        "reason": reason,
        "cases": first["cases"],
        "precision": found["loads_here"],
        "variants": results,
    }


def inputs_of(cases: list[dict[str, Any]]) -> str:
    """Which inputs ran: the build's own (remade from the manifest), or new ones at the build's sizes."""
    if all(c["the_builds_inputs"] for c in cases):
        return "on the build's inputs"
    if not any(c["the_builds_inputs"] for c in cases):
        return "on inputs made at the build's sizes"
    return "on the build's inputs, and inputs made at its sizes where it used the project's samples"


def show(data: dict[str, Any], out: Output) -> None:
    for problem in data["files"]["problems"]:
        out.line(f"FAILED  {problem}", style="red")
    for name, r in data["models"].items():
        if r["status"] == "ok":
            cases = ", ".join(c["case"] for c in r["cases"])
            compared = "matches eager, " if any("max_abs_err" in c for c in r["cases"]) else ""
            out.line(f"ok      {name}: ran {cases} ({compared}{inputs_of(r['cases'])})", style="green")
        elif r["status"] == "skipped":
            out.line(f"skipped {name}: {r['reason']}", style="yellow")
        else:
            out.line(f"FAILED  {name}: {r['reason']}", style="red")
        source = r.get("weights_source")
        if source and "url" in source:
            where = f"{'cached' if source['cached'] else 'not cached'} at {source['path']}"
            out.line(f"        weights from {source['url']}: {where}")
    counts = {s: sum(r["status"] == s for r in data["models"].values()) for s in ("ok", "failed", "skipped")}
    verdict = "passed" if data["passed"] else "FAILED"
    out.line(
        f"{verdict}: {data['files']['checked']} file digests checked; models: {counts['ok']} ok, "
        f"{counts['failed']} failed, {counts['skipped']} skipped"
        + (" (none was run)" if not counts["ok"] + counts["failed"] else "")
    )
