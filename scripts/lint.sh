#!/usr/bin/env bash
# Lint, format check and type check in a virtual environment of their own (.venv-lint): ruff and
# mypy as configured in pyproject.toml, with torch installed so that its types are known.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${HATCH_AOTI_LINT_VENV:-.venv-lint}
if [ -n "${HATCH_AOTI_LINT_IN:-}" ]; then
  # An existing venv that has torch (the test venv, in CI): add the tools to it.
  VENV=$HATCH_AOTI_LINT_IN
  "$VENV/bin/python" -m pip install -q -e ".[lint,s3]"
elif [ ! -x "$VENV/bin/mypy" ] || [ -n "${CI:-}" ]; then
  "$PYTHON" -m venv --clear "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" -e ".[lint,s3]"
fi
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"
"$VENV/bin/validate-pyproject" pyproject.toml sample_project/pyproject.toml sample_project_setuptools/pyproject.toml
