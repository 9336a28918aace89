#!/usr/bin/env bash
# The test suite from a fresh clone: installs the stack when it is missing (tools/install.sh; skipped in a few
# seconds when installed), then runs exactly `python -m pytest tests -q`, extra arguments passed through.
#
#   bash tools/run_tests.sh [pytest args...]      e.g. bash tools/run_tests.sh -x -k configs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
echo "[1/2] the stack (tools/install.sh)..."
bash tools/install.sh
echo "[2/2] $PY -m pytest tests -q $*"
exec "$PY" -m pytest tests -q "$@"
