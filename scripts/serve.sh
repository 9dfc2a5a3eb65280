#!/usr/bin/env bash
# Installs what is missing, builds what serving needs in Release, and runs the
# single-node cluster (1 coordinator, 1 prefill worker, 1 decode group of
# TP = 2) on the default model, serving the OpenAI-compatible API on
# http://127.0.0.1:8080.
#   scripts/serve.sh                    serve until Ctrl-C
#   scripts/serve.sh --demo "PROMPT"    stream one answer on a free port, then shut down
#   scripts/serve.sh [kvrelay launch flags...]   e.g. --port 0, --colocated 1 --prefill 0 --decode 0,
#                                       --coordinator-arg=--api-keys=keys.txt (docs/deploy.md)
# The build tree is build-serve/ (tests and benchmarks off: about a third of
# the full build's steps), its log build-serve/build.log; scripts/test.sh
# builds everything in build/.
# The RocksDB prefix store is on: each prefill worker keeps its prefix KV in
# kvstore/<worker id> (git-ignored), reused after a restart. --no-kv-store turns
# it off; --kv-store DIR puts it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=build-serve
LOG="$BUILD_DIR/build.log"

# The HTTP port: 8080 unless the caller names one; --demo takes a free one.
demo=0
port_given=0
for a in "$@"; do
  case "$a" in
    --demo | --demo=*) demo=1 ;;
    --port | --port=*) port_given=1 ;;
  esac
done
port_args=()
if [ "$demo" = 0 ] && [ "$port_given" = 0 ]; then
  port_args=(--port 8080)
  # Before a build of several minutes: another server on 8080 fails now.
  if (exec 3<>/dev/tcp/127.0.0.1/8080) 2>/dev/null; then
    echo "[serve] port 8080 is in use (another server?): pass --port N, or --port 0 for a free one" >&2
    exit 1
  fi
fi

./scripts/install-deps.sh
./scripts/fetch-model.sh
mkdir -p "$BUILD_DIR"
echo "[serve] building $BUILD_DIR (log: $LOG)"
./scripts/build.sh "$BUILD_DIR" -DKVRELAY_BUILD_TESTS=OFF -DKVRELAY_BUILD_BENCH=OFF >"$LOG" 2>&1 ||
  { tail -50 "$LOG"; echo "[serve] build failed; the full log is $LOG" >&2; exit 1; }
echo "[serve] build ok"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The prefill worker gets every core this process may use: a cold prompt's
# TTFT is its compute, and the two decode ranks (one thread each) wait for
# its KV meanwhile. Later flags (e.g. --prefill-threads 1) override it.
cores=$(nproc)
exec "$BUILD_DIR/cli/kvrelay" launch --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --prefill 1 --decode 1 --tp 2 "${port_args[@]}" --prefill-threads "$cores" "$@"
