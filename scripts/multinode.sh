#!/usr/bin/env bash
# The multi-node tests on emulated hosts (tests/multinode/): N "hosts" as network
# namespaces on a bridge, each with its own address, /etc/hosts, a tc-shaped link
# and a cgroup CPU budget; the cluster across them under mpirun
# (deploy/mpirun/launch.sh) and as the Kubernetes manifests' command lines
# (deploy/k8s); fault cases across hosts; the 1+1 / 2+2 / 4+4 scaling test.
# Needs root (namespaces, tc, cgroups). Everything it creates is removed when it
# ends, also on failure or Ctrl-C.
#
#   scripts/multinode.sh [--quick] [--build-dir DIR] [--out DIR] [-- flags for multinode.py]
#     --quick   the short form CI runs (under ~5 minutes): scaling 1+1 and 4+4 only,
#               two fault cases, the mpirun topology without its host-by-host twin
#   e.g. scripts/multinode.sh -- --cpu 0.25 --link 1gbit
# The last line is `scaling efficiency at 4+4: X.XX`.
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK="" BUILD=build OUT="" EXTRA=()
while [ $# -gt 0 ]; do
  case $1 in
    --quick) QUICK=--quick ;;
    --build-dir) BUILD=$2; shift ;;
    --out) OUT=$2; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "usage: $0 [--quick] [--build-dir DIR] [--out DIR] [-- multinode.py flags]" >&2; exit 2 ;;
  esac
  shift
done
if [ "$(id -u)" -ne 0 ]; then
  echo "multinode.sh: needs root (network namespaces, tc, cgroups)" >&2
  exit 2
fi

./scripts/install-deps.sh >/dev/null || exit 1
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || ./scripts/fetch-model.sh || exit 1
if [ ! -f "$BUILD/build.ninja" ]; then
  args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
  command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$BUILD" "${args[@]}" >/dev/null || exit 1
fi
echo "[multinode] building the daemons and the kvrelay CLI in $BUILD"
cmake --build "$BUILD" --target kvrelay-coordinator kvrelay-prefill kvrelay-decode kvrelay || exit 1

OUT=${OUT:-$BUILD/multinode}
mkdir -p "$OUT"
common=(--bin-dir "$BUILD/bin" --cli "$BUILD/cli/kvrelay" --venv "$BUILD/multinode-venv" "${EXTRA[@]}")
failed=()
run() {  # name, multinode.py args...
  local name=$1; shift
  echo
  echo "[multinode] ===== $name"
  python3 tests/multinode/multinode.py "$@" "${common[@]}" --workdir "$OUT/$name" \
      --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || failed+=("$name (exit $rc)")
}
run mpirun mpirun $QUICK
run k8s k8s
run faults faults $QUICK
run scaling scaling $QUICK

echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "[multinode] FAILED: ${failed[*]} (logs in $OUT)"
else
  echo "[multinode] all passed (logs and JSON in $OUT)"
fi
line=$(grep -h "^scaling efficiency at 4+4:" "$OUT/scaling.log" | tail -1)
echo "${line:-scaling efficiency at 4+4: n/a (no scaling result)}"
[ ${#failed[@]} -eq 0 ]
