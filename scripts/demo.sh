#!/usr/bin/env bash
# Build sample_project's wheel with `python -m build`, install it into a fresh venv that
# has torch but not hatch-aoti, and run its compiled models next to the eager ones.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q build
"$work/tools/bin/python" -m pip wheel -q --no-deps -w "$work/wheelhouse" .
# The isolated build installs hatch-aoti from this wheelhouse (plus any find-links you had).
PIP_FIND_LINKS="$work/wheelhouse ${PIP_FIND_LINKS:-}" \
  "$work/tools/bin/python" -m build --wheel -o "$work/dist" sample_project

"$PYTHON" -m venv "$work/run"
"$work/run/bin/python" -m pip install -q "torch==2.13.0"
"$work/run/bin/python" -m pip install -q "$work"/dist/sample_models-*.whl
echo "built and installed: $(basename "$work"/dist/sample_models-*.whl)"
cd "$work" && "$work/run/bin/python" "$OLDPWD/sample_project/demo.py"
