"""``python -m <package>.<loader> fetch [NAME...]``: what an image build or an air-gapped host runs."""

from __future__ import annotations

import sys

from . import fetch


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "fetch":
        print(f"usage: python -m {__package__} fetch [NAME...]", file=sys.stderr)
        return 2
    try:
        for name, path in fetch(*argv[1:]).items():
            print(f"{name}: {path}")
    except (RuntimeError, KeyError, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
