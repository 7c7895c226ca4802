"""``hatch-aoti verify WHEEL --torch VERSION``: the wheel's models against eager under other torch releases.

Each release gets an environment of its own, made with uv where it is on PATH and else with
venv and pip, each with the user's own index settings: that torch, then the wheel without its
dependencies, then its other requirements. There a worker (``window_worker.py``: torch and
hatch-aoti's pure-Python modules, nothing installed) loads each model, in a process of its own,
and runs it against eager on the build's verification inputs, as ``hatch-aoti verify --eager``
does. The result is a table, release by model, and the narrowest ``torch-requirement`` the
passing releases support.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import venv
from pathlib import Path
from typing import Any

from hatch_aoti.cli.output import Output
from hatch_aoti.cli.target import CliError, Target


def run(target: Target, out: Output, versions: list[str], envs: Path | None) -> int:
    if target.kind != "wheel":
        raise CliError(
            f"--torch installs the wheel into environments of its own: give a wheel file, not {target.where}"
        )
    built = str(target.manifest.get("torch", "?"))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hatch-aoti-window-") as tmp:
        root = envs or Path(tmp)
        for version in versions:
            out.line(
                f"torch {version}: preparing an environment ({'uv' if shutil.which('uv') else 'venv and pip'})",
                style="dim",
            )
            results[version] = one_release(target, version, root / f"torch-{version}", Path(tmp))
    passing = [
        v
        for v, r in results.items()
        if "error" not in r and all(m["status"] in ("pass", "skipped") for m in r["models"].values())
    ]
    precompiled = any(m.get("backend") == "precompile" for m in target.models.values())
    requirement = f"torch=={built.split('+')[0]}" if precompiled else narrowest([built, *passing])
    data = {
        "target": target.where,
        "built_with": built,
        "versions": results,
        "passed": len(passing) == len(results),
        "requirement": requirement,
    }
    out.data(data)
    if not out.json:
        show(data, out)
    return 0 if data["passed"] else 1


def one_release(target: Target, version: str, where: Path, tmp: Path) -> dict[str, Any]:
    """The worker's report from an environment with this torch, or the error that stopped it."""
    try:
        python = environment(version, where)
        install(python, ["--no-deps", target.where], reinstall=True)  # a kept environment may hold an older build
        others = [r for r in target.dist.requires if not _is_torch(r)]
        if others:  # torch named too: they may not replace the torch under test
            install(python, [*others, f"torch=={version}"])
    except subprocess.CalledProcessError as exc:
        return {"error": f"could not install: {' '.join(map(str, exc.cmd[-3:]))}: {_last_line(exc.stderr)}"}
    report = worker(python, target, tmp)
    if report.get("torch") and str(report["torch"]).split("+")[0] != version:
        return {"error": f"the environment has torch {report.get('torch')}, not {version}"}
    return report


def environment(version: str, where: Path) -> Path:
    """A venv at ``where`` with ``torch==version``; one already there with that torch is used again."""
    python = where / "bin" / "python"
    if python.exists() and _torch_in(python) == version:
        return python
    shutil.rmtree(where, ignore_errors=True)
    uv = shutil.which("uv")
    if uv:
        _run([uv, "venv", "--quiet", "--python", sys.executable, str(where)])
    else:
        venv.EnvBuilder(with_pip=True).create(where)
    install(python, [f"torch=={version}"])
    return python


def install(python: Path, args: list[str], reinstall: bool = False) -> None:
    uv = shutil.which("uv")
    if uv:
        _run([uv, "pip", "install", "--quiet", "--python", str(python), *(["--reinstall"] if reinstall else []), *args])
    else:
        _run([str(python), "-m", "pip", "install", "--quiet", *(["--force-reinstall"] if reinstall else []), *args])


#: How long one model's check may take in another release's environment (loading, then eager and
#: compiled on every case), in seconds: ``HATCH_AOTI_VERIFY_TIMEOUT``.
DEFAULT_TIMEOUT_S = 900


def model_timeout() -> int:
    raw = os.environ.get("HATCH_AOTI_VERIFY_TIMEOUT", "")
    if not raw.strip():
        return DEFAULT_TIMEOUT_S
    if not raw.strip().isdigit() or int(raw) < 1:
        raise CliError(f"HATCH_AOTI_VERIFY_TIMEOUT must be a whole number of seconds >= 1, not {raw!r}")
    return int(raw)


def worker(python: Path, target: Target, tmp: Path) -> dict[str, Any]:
    """Run ``window_worker`` there for each model in a process of its own (a crash or a hang costs that
    model alone), with hatch-aoti's own modules on its path and nothing else of ours."""
    import hatch_aoti

    path = tmp / "hatch-aoti-modules"
    if not path.exists():
        path.mkdir()
        (path / "hatch_aoti").symlink_to(Path(hatch_aoti.__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(path)}
    report: dict[str, Any] = {"models": {}}
    for name in target.models:
        found = _check(python, target, name, env, tmp)
        report["torch"] = found.pop("torch", report.get("torch"))
        report["models"][name] = found
    return report


def _check(python: Path, target: Target, name: str, env: dict[str, str], tmp: Path) -> dict[str, Any]:
    """One model's check in a process group of its own: a hang ends with everything it started."""
    command = [str(python), "-m", "hatch_aoti.cli.window_worker", target.package, target.loader_name, name]
    limit = model_timeout()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"status": "fails", "reason": f"did not finish in {limit} s (HATCH_AOTI_VERIFY_TIMEOUT)"}
    try:
        found: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return found
    except (IndexError, ValueError):
        return {"status": "fails", "reason": f"the check crashed (exit status {proc.returncode}): {_last_line(err)}"}


def narrowest(versions: list[str]) -> str:
    """The narrowest torch requirement that allows the release series in ``versions`` (the first is the
    build's), over consecutive series only: a series between them that was not tried is not promised."""
    from packaging.version import InvalidVersion, Version

    series = set()
    for text in versions:
        try:
            series.add(Version(text).release[:2])
        except InvalidVersion:
            continue
    if not series:
        return ""
    built = Version(versions[0]).release[:2] if versions[0] and versions[0][0].isdigit() else min(series)
    low = high = built
    while (low[0], low[1] - 1) in series:
        low = (low[0], low[1] - 1)
    while (high[0], high[1] + 1) in series:
        high = (high[0], high[1] + 1)
    if low == high:
        return f"torch=={low[0]}.{low[1]}.*"
    return f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"


def show(data: dict[str, Any], out: Output) -> None:
    versions = data["versions"]
    names = sorted({name for r in versions.values() for name in r.get("models", {})})
    rows = []
    for name in names:
        row = [name]
        for result in versions.values():
            model = result.get("models", {}).get(name)
            row.append(_cell(model) if model else result.get("error", "?"))
        rows.append(row)
    for version, result in versions.items():
        if "error" in result:
            out.line(f"FAILED  torch {version}: {result['error']}", style="red")
    out.table(["model", *(f"torch {v}" for v in versions)], rows, title=f"built with torch {data['built_with']}")
    verdict = "passed" if data["passed"] else "FAILED"
    out.line(f"{verdict}: the narrowest torch-requirement these releases support: {data['requirement']!r}")


def _cell(model: dict[str, Any]) -> str:
    return model["status"] if model["status"] in ("pass", "skipped") else f"{model['status']}: {model['reason']}"


def _torch_in(python: Path) -> str | None:
    code = "import importlib.metadata as m; print(m.version('torch'))"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return proc.stdout.strip().split("+")[0] if proc.returncode == 0 else None


def _is_torch(requirement: str) -> bool:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return Requirement(requirement).name.lower() == "torch"
    except InvalidRequirement:
        return False


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
