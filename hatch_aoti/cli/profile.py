"""``hatch-aoti profile``: a Chrome / Perfetto trace (``torch.profiler``) of calls to one compiled model.

Each call is a ``record_function`` span named after the model. Inside it the trace shows
the ATen operators the compiled code calls (extern kernels such as matmuls); a library
built with Inductor's kernel profiling (``cpp.enable_kernel_profile``) also records each
generated kernel (``graph_0_cpp_fused_...``) and each call into torch's C shim
(``aoti_torch_cpu_...``). CUDA models add the GPU kernels the profiler sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatch_aoti.cli import calls, models
from hatch_aoti.cli.output import Output
from hatch_aoti.cli.target import CliError, Target


def run(
    target: Target,
    out: Output,
    name: str,
    trace: Path,
    calls_n: int,
    shapes: list[str],
    package_code: bool,
    eager: bool,
    top: int,
) -> int:
    entry = target.model(name)
    try:
        sizes = {**calls.example_sizes(entry), **calls.parse_shape(shapes, entry)}
    except ValueError as exc:
        raise CliError(str(exc)) from None
    writable(trace)
    try:
        compiled = models.compiled(target, name, package_code)
        module = models.eager(target, name) if eager else None
    except models.Unavailable as exc:
        raise CliError(f"{name}: {exc}") from None
    events = record(
        name, compiled, module, calls.make_inputs(entry, sizes, calls.in_spec(entry, compiled)), calls_n, trace
    )
    kernel_profile = bool(entry.get("inductor_configs", {}).get("cpp.enable_kernel_profile"))
    data = {
        "target": target.where,
        "model": name,
        "inputs": calls.describe(entry, sizes),
        "calls": calls_n,
        "trace": str(trace),
        "kernel_profile": kernel_profile,
        "top": events[:top],
    }
    out.data(data)
    if not out.json:
        show(data, out)
    return 0


def writable(trace: Path) -> None:
    """Refuse, before profiling, a trace path that cannot be written."""
    if trace.is_dir():
        raise CliError(f"-o {trace}: is a directory; name the trace file, e.g. {trace / 'trace.json'}")
    existed = trace.exists()
    try:
        trace.parent.mkdir(parents=True, exist_ok=True)
        with trace.open("a"):
            pass
        if not existed:
            trace.unlink()  # written only once the calls have run
    except OSError as exc:
        raise CliError(f"-o {trace}: cannot write there ({exc.strerror or exc})") from None


def record(name: str, compiled: Any, module: Any, inputs: tuple[Any, Any], n: int, trace: Path) -> list[dict[str, Any]]:
    """Profile ``n`` calls (after three unrecorded ones), write the trace; the ops by self time."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    args, kwargs = inputs
    runs = {f"{name} (compiled)": compiled, **({f"{name} (eager)": module} if module is not None else {})}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with torch.no_grad():
            for fn in runs.values():
                for _ in range(3):
                    fn(*args, **kwargs)
            with profile(activities=activities, record_shapes=True) as prof:
                for label, fn in runs.items():
                    for _ in range(n):
                        with record_function(label):
                            fn(*args, **kwargs)
    except Exception as exc:
        raise CliError(f"{name}: a call failed: {type(exc).__name__}: {models.first_line(exc)}") from None
    trace.unlink(missing_ok=True)
    prof.export_chrome_trace(str(trace))  # logs rather than raises when it cannot write
    if not trace.is_file() or trace.stat().st_size == 0:
        Path(f"{trace}.tmp").unlink(missing_ok=True)
        raise CliError(f"-o {trace}: torch.profiler could not write the trace")
    rows = [
        {"name": e.key, "calls": e.count, "self_us": e.self_cpu_time_total, "total_us": e.cpu_time_total}
        for e in prof.key_averages()
    ]
    return sorted(rows, key=lambda r: -r["self_us"])


def show(data: dict[str, Any], out: Output) -> None:
    out.line(
        f"{data['model']}: {data['calls']} calls at {data['inputs']}; trace written to {data['trace']} "
        "(open it in https://ui.perfetto.dev or chrome://tracing)"
    )
    rows = [[e["name"], e["calls"], f"{e['self_us']:.0f}", f"{e['total_us']:.0f}"] for e in data["top"]]
    out.table(["op / kernel", "calls", "self CPU us", "CPU total us"], rows, title="Top by self CPU time")
    if not data["kernel_profile"]:
        out.line(
            "Generated kernels are not in this trace: the library was built without kernel profiling. "
            'Build a profiling wheel with inductor-configs = { "cpp.enable_kernel_profile" = true } '
            "or TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 to see them."
        )
