#!/usr/bin/env bash
# Build sample_project's wheel, install it into a fresh venv that has torch but not
# hatch-aoti, and run its compiled models next to the eager ones.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "built and installed: $(bash scripts/sample_env.sh "$work")"
(cd "$work" && "$work/run/bin/python" "$OLDPWD/sample_project/demo.py")
