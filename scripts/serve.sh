#!/usr/bin/env bash
# Installs what is missing, builds in Release, and runs the single-node cluster
# (1 coordinator, 1 prefill worker, 1 decode group of TP = 2) on the default model,
# serving the OpenAI-compatible API on http://127.0.0.1:8080.
#   scripts/serve.sh                    serve until Ctrl-C
#   scripts/serve.sh --demo "PROMPT"    stream one answer, then shut down
#   scripts/serve.sh [kvrelay launch flags...]   e.g. --colocated 1 --prefill 0 --decode 0
# The RocksDB prefix store is on: each prefill worker keeps its prefix KV in
# kvstore/<worker id> (git-ignored), reused after a restart. --no-kv-store turns
# it off; --kv-store DIR puts it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh
./scripts/fetch-model.sh
./scripts/build.sh build >/tmp/kvrelay-build.log 2>&1 || { tail -50 /tmp/kvrelay-build.log; exit 1; }
echo "[serve] build ok"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The prefill worker gets every core this process may use: a cold prompt's
# TTFT is its compute, and the two decode ranks (one thread each) wait for
# its KV meanwhile. Later flags (e.g. --prefill-threads 1) override it.
cores=$(nproc)
exec build/cli/kvrelay launch --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --prefill 1 --decode 1 --tp 2 --port 8080 --prefill-threads "$cores" "$@"
