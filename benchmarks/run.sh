#!/usr/bin/env bash
# Build and install sample_project as a user would, then measure its loader:
# cold start vs `import torch`, per call vs the raw runner / aoti_load_package / eager,
# and files written at load. Extra arguments go to benchmarks/loader.py.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "built and installed: $(bash scripts/sample_env.sh "$work")"
(cd "$work" && "$work/run/bin/python" "$OLDPWD/benchmarks/loader.py" "$@")
