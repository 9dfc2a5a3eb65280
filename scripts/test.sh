#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite.
# Exit status is non-zero on any failure.
#   scripts/test.sh              all tests (unit + integration)
#   scripts/test.sh -L unit      only one label (extra args go to ctest)
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh
./scripts/fetch-model.sh
./scripts/build.sh build

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "[test] running ctest"
cd build
ctest --output-on-failure -LE slow -j 2 "$@"
