#!/usr/bin/env bash
# Builds and runs the `sanitize`-labelled tests (protocols, KV transfer, the
# control plane's security tests, the fuzz corpus replays, and the daemons:
# a TP-2 cluster through a fault, tests/faults/sanitized_cluster_test.cc)
# under a sanitizer, in its own build tree, with -Werror. A sanitizer report
# fails the test.
#   scripts/sanitize.sh asan     AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)
#   scripts/sanitize.sh tsan     ThreadSanitizer (build-tsan/)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-asan}
case $kind in
  asan) dir=build-asan; opt=-DKVRELAY_SANITIZE=ON ;;
  tsan) dir=build-tsan; opt=-DKVRELAY_TSAN=ON ;;
  *) echo "usage: $0 asan|tsan" >&2; exit 2 ;;
esac
# -O1 -g1: the optimization the sanitizers' own docs advise, and line tables
# only, which is all a report's stack needs. Both are for the compile time
# these two trees add to ./scripts/test.sh: coordinator/http/session.cc under
# ASan compiles in 78 s with -O1 -g1, 133 s with -O2 -g1 (2026-12-08), and
# -O2 -g had cost another ~35 % (263 s vs 193 s on an earlier host).
args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
      "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DKVRELAY_WERROR=ON -DKVRELAY_WITH_CUDA=OFF "$opt")
command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
# Configured every time (seconds when the tree exists), so the list of
# tests below is the current source's, not the tree's last configure.
cmake -S . -B "$dir" "${args[@]}" > /dev/null
# Every sanitize test is named after its executable.
targets=$(ctest --test-dir "$dir" -N -L sanitize 2>/dev/null | sed -n 's/^ *Test *#[0-9]*: //p')
if [ -z "$targets" ]; then
  echo "sanitize.sh: no test carries the sanitize label in $dir" >&2
  exit 1
fi
cmake --build "$dir" --target $targets
ctest --test-dir "$dir" -L sanitize --output-on-failure
