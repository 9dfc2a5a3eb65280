#!/usr/bin/env bash
# Configures and builds kvrelay with CMake + Ninja (+ ccache when present).
# usage: scripts/build.sh [BUILD_DIR] [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
shift || true

args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
[ "${CI:-}" = "true" ] && args+=(-DKVRELAY_WERROR=ON)

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  echo "[build] configuring $BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" "${args[@]}" "$@"
fi
echo "[build] compiling (ninja shows [done/total])"
cmake --build "$BUILD_DIR" -j "$(nproc)"
