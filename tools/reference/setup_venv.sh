#!/usr/bin/env bash
# Creates the Python environment that records llama.cpp reference data
# (tools/reference/record_llamacpp.py). Idempotent: reuses an existing venv.
#
#   tools/reference/setup_venv.sh [VENV_DIR]     (default: <repo>/.venv-reference)
#
# llama-cpp-python compiles llama.cpp from source (CPU only); this takes several
# minutes on two cores. The version is pinned so recorded data is reproducible.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-${ROOT}/.venv-reference}"
LLAMA_CPP_PYTHON_VERSION="0.3.36"

if [ ! -x "${VENV}/bin/python" ]; then
  python3 -m venv "${VENV}"
fi
if "${VENV}/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '${LLAMA_CPP_PYTHON_VERSION}')" 2>/dev/null; then
  echo "[reference] ${VENV} already has llama-cpp-python ${LLAMA_CPP_PYTHON_VERSION}"
  exit 0
fi
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
  "${VENV}/bin/pip" install "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" numpy jinja2
echo "[reference] ready: ${VENV}/bin/python tools/reference/record_llamacpp.py"
