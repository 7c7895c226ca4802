"""``hatch-aoti inspect``: what a wheel holds and whether this machine can run it, without loading anything."""

from __future__ import annotations

import os
from typing import Any

from hatch_aoti.cli import calls, machine
from hatch_aoti.cli.integrity import shipped
from hatch_aoti.cli.output import Output, human_size
from hatch_aoti.cli.target import Target
from hatch_aoti.loader.schema import Entry, precision_of, variants_of
from hatch_aoti.pipeline.artifacts import ARTIFACT_DIR


def collect(target: Target) -> dict[str, Any]:
    manifest, dist = target.manifest, target.dist
    return {
        "target": target.where,
        "kind": target.kind,
        "package": target.package,
        "loader": f"{target.package}.{target.loader_name}",
        "distribution": {"name": dist.name, "version": dist.version, "tags": dist.tags, "requires": dist.requires},
        "built_with": {"hatch_aoti": manifest.get("hatch_aoti"), "torch": manifest.get("torch")},
        "this_machine": {
            "arch": os.uname().machine,
            "torch": machine.installed_torch(),
            "torch_problem": machine.torch_problem(target),
        },
        "files": package_files(target),
        "models": {name: model(target, name, entry) for name, entry in target.models.items()},
    }


def package_files(target: Target) -> list[dict[str, Any]]:
    """The loader's modules, the manifest and any backend run-time modules, with RECORD's digests where it has them."""
    paths = [
        *sorted((target.package_dir / target.loader_name).glob("*.py")),
        *sorted((target.package_dir / ARTIFACT_DIR).glob("*.*")),
        *sorted((target.package_dir / ARTIFACT_DIR / "runtime").glob("*.py")),
    ]
    record = target.dist.digests()
    return [
        {
            "path": p.relative_to(target.package_dir).as_posix(),
            "size": target.size(p),
            "recorded_sha256": record.get(p.resolve(), ""),
        }
        for p in paths
        if p.is_file()
    ]


def model(target: Target, name: str, entry: Entry) -> dict[str, Any]:
    configs = entry.get("inductor_configs", {})
    external = "external" in entry.get("weights", {})
    problems = machine.problems(target, name)
    return {
        **machine.variants(target, name),
        "backend": entry.get("backend", "aoti"),
        "device": entry.get("device"),
        "factory": entry.get("factory"),
        "inputs": calls.describe(entry),
        "dynamic": {d: {"min": lo, "max": hi} for d, (lo, hi) in calls.dims(entry).items()},
        "cpu": machine.variant_of(target, name)["cpu"],  # of the variant that loads here
        "runs_here": not problems,
        "problems": problems,
        "weights": "external" if external else "mapped" if "weights" in entry else "in the library",
        "weights_source": machine.weights_source(target, name) if external else None,
        "kernel_profile": bool(configs.get("cpp.enable_kernel_profile")),
        "packed_at_load": machine.packed_at_load(target, name),
        "inductor_configs": configs,
        "verification": entry.get("verification"),
        "variant_verification": {precision_of(v): v.get("verification") for v in variants_of(entry)},
        "needs": entry.get("needs", {}),
        "tuning": entry.get("tuning"),
        "files": [
            {
                "path": f"{ARTIFACT_DIR}/{path}",
                "size": target.size(target.package_dir / ARTIFACT_DIR / path),
                "recorded_sha256": digest,
            }
            for path, _, digest in shipped(name, entry)
        ],
    }


def run(target: Target, out: Output) -> int:
    data = collect(target)
    out.data(data)
    if not out.json:
        show(data, out)
    return 0


def show(data: dict[str, Any], out: Output) -> None:
    dist, here = data["distribution"], data["this_machine"]
    out.line(f"{data['target']} ({data['kind']}): {dist['name']} {dist['version']}".rstrip(), style="bold")
    out.line(f"  loader:        {data['loader']}")
    out.line(f"  built with:    hatch-aoti {data['built_with']['hatch_aoti']}, torch {data['built_with']['torch']}")
    out.line(f"  wheel tag:     {', '.join(dist['tags']) or '?'}")
    out.line(f"  Requires-Dist: {', '.join(dist['requires']) or 'none'}")
    torch_line = f"torch {here['torch']}" if here["torch"] else "no torch"
    out.line(
        f"  this machine:  {here['arch']}, {torch_line}"
        + (f": {here['torch_problem']}" if here["torch_problem"] else "")
    )
    rows = []
    for name, m in data["models"].items():
        dynamic = ", ".join(
            f"{d} {r['min']}..{r['max'] if r['max'] is not None else 'inf'}" for d, r in m["dynamic"].items()
        )
        rows.append(
            [
                name,
                m["backend"],
                m["device"],
                m["inputs"],
                dynamic or "static",
                m["cpu"]["target"],
                "; ".join(m["problems"]) or "yes",
            ]
        )
    out.table(["model", "backend", "device", "inputs", "dynamic", "cpu target", "runs here"], rows)
    for name, m in data["models"].items():
        out.line(f"{name}:", style="bold")
        out.line(f"  CPU features needed: {' '.join(m['cpu']['features']) or 'none'}")
        if len(m["variants"]) > 1 or m["variants"][0]["precision"] != "float32":
            targets = {v["cpu_target"] for v in m["variants"]}
            listed = ", ".join(
                v["precision"]
                + "".join(f" (+{also})" for also in v["uses"])
                + (f" ({v['cpu_target']})" if len(targets) > 1 else "")
                + ("" if v["native_here"] else " (not native here)")
                for v in m["variants"]
            )
            out.line(f"  precision: {listed}; loads here: {m['loads_here'] or 'none'}")
        count = m["packed_at_load"]
        packed = f"; {count} packed for the CPU at load" if count else ""
        packed = "; packing at load unknown" if count is None else packed
        profiling = "compiled in" if m["kernel_profile"] else "off"
        out.line(f"  weights {m['weights']}{packed}; kernel profiling {profiling}")
        for precision, report in m["variant_verification"].items():
            which = f" ({precision})" if len(m["variant_verification"]) > 1 or precision != "float32" else ""
            out.line(f"  verified at build{which}: {_verified(report)}")
        source = m["weights_source"]
        if source:
            cached = "cached here" if source.get("cached") else "not cached here yet"
            out.line(
                f"  weights from {source.get('url', '?')}: {cached}"
                if "url" in source
                else f"  weights: {source['problem']}"
            )
        for what, need in m["needs"].items():
            out.line(f"  needs {what}: {need}")
        if m["tuning"]:
            out.line(f"  tuned (times from {m['tuning'].get('timed_on', 'the build machine')}):")
            for row in m["tuning"].get("candidates", []):
                mark = " (kept)" if row.get("candidate") == m["tuning"].get("chosen") else ""
                how = f"{row['ms']:.2f} ms per call" if "ms" in row else f"dropped at {row.get('dropped')}"
                out.line(f"    {row.get('candidate')}: {how}{mark}")
    files = [*data["files"], *(f for m in data["models"].values() for f in m["files"])]
    out.table(
        ["file (in the package)", "size", "recorded sha256"],
        [[f["path"], human_size(f["size"]), f["recorded_sha256"] or "-"] for f in files],
    )


def _verified(report: dict[str, Any] | None) -> str:
    if not report:
        return "?"
    if report.get("passed") is None:
        return f"skipped ({report.get('skipped', '')})"
    shapes = "; ".join(f"{t['inputs']} {t['shapes']}" for t in report.get("tried", []))
    tolerance = ""
    if report.get("rtol") is not None or report.get("atol") is not None:
        tolerance = f" rtol={report.get('rtol')} atol={report.get('atol')}"
    if "precision" in report:  # a lower-precision variant: against float32 eager
        limits = f"relative error <= {report.get('rel_error')}, cosine >= {report.get('cosine')}"
        tolerance = f" against float32 eager, {limits}"
    return f"{'passed' if report['passed'] else 'FAILED'}{tolerance}: {shapes}"
