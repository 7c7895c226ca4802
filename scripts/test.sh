#!/usr/bin/env bash
# Run the test suite in a fresh virtual environment (.venv-test): torch (CPU build),
# hatch-aoti itself and the test tools. Extra arguments go to pytest. The tests run in two processes
# (HATCH_AOTI_TEST_WORKERS; 0 for one): a build leaves a core idle much of the time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${HATCH_AOTI_TEST_VENV:-.venv-test}
"$PYTHON" -m venv --clear "$VENV"
"$VENV/bin/python" -m pip install -q "torch==2.13.0" -e ".[test]"
exec "$VENV/bin/python" -m pytest -n "${HATCH_AOTI_TEST_WORKERS:-2}" --dist loadgroup "$@"
