"""``hatch-aoti``: inspect, verify, bench and profile a wheel built by hatch-aoti, and manage the compile cache.

Every command takes ``--json``. A bad target, a wheel not built by hatch-aoti or an
unknown model is one line on stderr and exit status 2; ``verify`` exits 1 when a file or
a model fails, or when no model could be run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hatch_aoti.cli.output import Output

DESCRIPTION = "inspect, verify, bench and profile a wheel built by hatch-aoti, and manage the compile cache"
TARGET_HELP = (
    "a wheel file, an installed package (my_pkg or my_pkg.compiled), or a project directory (its newest dist/*.whl)"
)


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: given after the command it sets the flag, and leaves one given before it alone.
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document, for scripts and CI"
    )
    package_code = argparse.ArgumentParser(add_help=False)
    package_code.add_argument(
        "--import-package",
        action="store_true",
        help="allow importing the package's own code, which precompiled models run when loaded (implied by --eager)",
    )
    top = argparse.ArgumentParser(prog="hatch-aoti", description=DESCRIPTION)
    top.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    top.add_argument("--json", action="store_true", help="print one JSON document, for scripts and CI")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser("inspect", parents=[common], help="models, inputs, CPU target, files, verification")
    inspect.add_argument("target", help=TARGET_HELP)

    verify = commands.add_parser(
        "verify", parents=[common, package_code], help="check files, then load and run every model here"
    )
    verify.add_argument("target", help=TARGET_HELP)
    verify.add_argument("--eager", action="store_true", help="also compare with the eager model (imports the package)")
    verify.add_argument(
        "--torch",
        action="append",
        default=[],
        metavar="VERSION",
        help="instead, install the wheel beside this torch in an environment of its own and compare "
        "every model with eager there; repeatable",
    )
    verify.add_argument(
        "--envs",
        type=Path,
        metavar="DIR",
        help="with --torch: keep each environment in DIR/torch-VERSION and use it again",
    )

    bench = commands.add_parser("bench", parents=[common, package_code], help="per-call latency and cold start")
    bench.add_argument("target", help=TARGET_HELP)
    bench.add_argument("model", nargs="?", help="one model (default: all)")
    bench.add_argument("--eager", action="store_true", help="time the eager model too (imports the package)")
    bench.add_argument("--warmup", type=_positive, default=3, help="unrecorded calls first (default 3)")
    bench.add_argument("--repeats", type=_positive, default=7, help="timed rounds (default 7)")
    bench.add_argument("--min-time", type=_seconds, default=0.05, help="seconds a round lasts at least (default 0.05)")
    bench.add_argument(
        "--cold", type=_count, default=5, help="fresh-process rounds for cold start, 0 to skip (default 5)"
    )

    profile = commands.add_parser(
        "profile", parents=[common, package_code], help="a Chrome/Perfetto trace of calls to one model"
    )
    profile.add_argument("target", help=TARGET_HELP)
    profile.add_argument("model")
    profile.add_argument(
        "-o", "--output", type=Path, default=Path("trace.json"), help="trace file (default trace.json)"
    )
    profile.add_argument("--calls", type=_positive, default=10, help="calls to record (default 10)")
    profile.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="DIM=SIZE",
        help="size of a dynamic dim (default: the example size); repeatable",
    )
    profile.add_argument("--eager", action="store_true", help="profile the eager model too (imports the package)")
    profile.add_argument("--top", type=_positive, default=15, help="rows of the summary table (default 15)")

    cache = commands.add_parser("cache", help="the compile cache: info, prune, clear")
    actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("info", parents=[common], help="entries, sizes, last use, the bytecode store")
    prune = actions.add_parser("prune", parents=[common], help="remove entries used longest ago, down to a size")
    prune.add_argument("--max-size", help="size to prune to, e.g. 5GB (default: HATCH_AOTI_CACHE_MAX_SIZE or 20GiB)")
    actions.add_parser("clear", parents=[common], help="remove every entry no build is using, and the bytecode store")
    return top


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 3600:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, not {text!r}")
    return int(text)


def _version() -> str:
    from hatch_aoti import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    from hatch_aoti.cli.output import Output
    from hatch_aoti.cli.target import CliError

    args = parser().parse_args(argv)
    out = Output(args.json)
    saved = list(sys.path)
    # `python -m` puts the current directory on the path: a project's source folder there
    # would hide the installed package of the same name.
    sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
    try:
        return dispatch(args, out)
    except CliError as exc:
        return fail(out, str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `hatch-aoti ... | head`: the reader has gone, and so does the rest of the output
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        if os.environ.get("HATCH_AOTI_DEBUG"):
            raise
        return fail(out, f"unexpected {type(exc).__name__}: {exc} (set HATCH_AOTI_DEBUG=1 for the traceback)")
    finally:
        sys.path[:] = saved


def fail(out: Output, message: str) -> int:
    message = " ".join(message.split())
    if out.json:
        out.data({"error": message})
    print(f"hatch-aoti: error: {message}", file=sys.stderr)
    return 2


def dispatch(args: argparse.Namespace, out: Output) -> int:
    from hatch_aoti.cli import bench, cache, inspect, profile, verify
    from hatch_aoti.cli.target import CliError, open_target

    if args.command == "cache":
        if args.action == "info":
            return cache.info(out)
        return cache.prune(out, args.max_size) if args.action == "prune" else cache.clear(out)
    package_code = getattr(args, "import_package", False) or getattr(args, "eager", False)
    with open_target(args.target, extract=args.command != "inspect") as target:
        if args.command == "inspect":
            return inspect.run(target, out)
        if args.command == "verify" and args.envs and not args.torch:
            raise CliError("--envs keeps the environments of --torch; give --torch VERSION too")
        if args.command == "verify" and args.torch:
            from hatch_aoti.cli import window

            return window.run(target, out, args.torch, args.envs)
        if args.command == "verify":
            return verify.run(target, out, package_code, args.eager)
        if args.command == "bench":
            timing = (args.warmup, args.repeats, args.min_time)
            return bench.run(target, out, args.model, package_code, args.eager, timing, args.cold)
        return profile.run(
            target, out, args.model, args.output, args.calls, args.shape, package_code, args.eager, args.top
        )
