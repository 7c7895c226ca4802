#!/usr/bin/env bash
# Usage: scripts/sample_env.sh DIR
# Build sample_project's wheel with `python -m build` (isolated; hatch-aoti comes from a
# wheel of this checkout) and install it into DIR/run, a fresh venv with torch but not
# hatch-aoti. Prints the wheel's name.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$1
mkdir -p "$work"
"$PYTHON" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q build
"$work/tools/bin/python" -m pip wheel -q --no-deps -w "$work/wheelhouse" .
PIP_FIND_LINKS="$work/wheelhouse ${PIP_FIND_LINKS:-}" \
  "$work/tools/bin/python" -m build --wheel -o "$work/dist" sample_project >&2
"$PYTHON" -m venv "$work/run"
"$work/run/bin/python" -m pip install -q "torch==2.13.0" numpy
"$work/run/bin/python" -m pip install -q "$work"/dist/sample_models-*.whl
basename "$work"/dist/sample_models-*.whl
