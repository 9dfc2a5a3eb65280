#!/usr/bin/env bash
# Creates the venv the planner's plots use (matplotlib from PyPI).
# Idempotent: reuses an existing venv.
#   sim/plot/setup_venv.sh [VENV_DIR]     (default: <repo>/.venv-sim)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-${ROOT}/.venv-sim}"
if [ ! -x "${VENV}/bin/python" ]; then
  python3 -m venv "${VENV}"
fi
if ! "${VENV}/bin/python" -c "import matplotlib" 2>/dev/null; then
  "${VENV}/bin/pip" install --quiet "matplotlib>=3.7"
fi
echo "${VENV}/bin/python"
