#!/usr/bin/env bash
# Cluster serving benchmark (not a test): `kvrelay bench serve` against local
# clusters started with `kvrelay launch`.
#   1. colocated (C workers) vs disaggregated (1 prefill + 1 decode, decode
#      TP = 1 and TP = 2) at three Poisson request rates, same model and workload;
#   2. a shared-prefix workload (G distinct prefixes, one per prompt at random)
#      on 2 prefill + 1 decode workers with --router prefix_aware vs
#      round_robin (prefix-cache hit rate, TTFT).
# Prints one summary line per run (medians) and leaves the JSON reports in
# $OUT (default /tmp/kvrelay-serve-compare).
#
#   bench/serve_compare.sh [-b build-dir] [-r "0.5 1 2"] [-n prompts] [-i input-len] [-o output-len]
#                          [-c colocated-workers] [-s shared-prefix] [-g prefix-groups]
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build RATES="0.5 1 2" N=24 IN=128 OUTLEN=32 COLOC=2 SHARED=96 NGROUPS=4
OUT=${OUT:-/tmp/kvrelay-serve-compare}
while getopts "b:r:n:i:o:c:s:g:" opt; do
  case $opt in
    b) BUILD=$OPTARG ;; r) RATES=$OPTARG ;; n) N=$OPTARG ;; i) IN=$OPTARG ;; o) OUTLEN=$OPTARG ;;
    c) COLOC=$OPTARG ;; s) SHARED=$OPTARG ;; g) NGROUPS=$OPTARG ;;
    *) echo "usage: $0 [-b build] [-r rates] [-n prompts] [-i in] [-o out] [-c colocated] [-s prefix]" >&2
       exit 2 ;;
  esac
done
KVRELAY=$BUILD/cli/kvrelay
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

LAUNCH_PID=""
stop_cluster() {
  if [ -n "$LAUNCH_PID" ]; then
    kill -TERM "$LAUNCH_PID" 2>/dev/null || true
    wait "$LAUNCH_PID" 2>/dev/null || true
    LAUNCH_PID=""
  fi
}
trap stop_cluster EXIT

# start_cluster NAME ARGS...: launches and waits (up to 120 s) for /health.
start_cluster() {
  local name=$1; shift
  "$KVRELAY" launch --bin-dir "$BUILD/bin" --model "$MODEL" --port "$PORT" --threads-per-worker 1 \
    --kv-dtype f16 "$@" >"$OUT/$name.launch.log" 2>&1 &
  LAUNCH_PID=$!
  for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$LAUNCH_PID" 2>/dev/null; then
      echo "cluster $name exited; see $OUT/$name.launch.log" >&2; exit 1
    fi
    sleep 0.5
  done
  echo "cluster $name not healthy within 120 s" >&2; exit 1
}

summary() {  # summary NAME JSON
  python3 - "$1" "$2" <<'EOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
r = json.load(open(path))
hit = r["cached_prompt_tokens"] / r["total_input_tokens"] if r["total_input_tokens"] else 0
print(f'{name:<34} rate {str(r["rate"]):>4}  ok {r["completed"]:>3}/{r["num_prompts"]:<3} '
      f'TTFT p50 {r["ttft_ms"]["p50"]:8.1f} ms  TPOT p50 {r["tpot_ms"]["p50"]:7.1f} ms  '
      f'E2E p50 {r["e2e_ms"]["p50"]:8.1f} ms  out {r["output_token_throughput"]:6.1f} tok/s  '
      f'prefix hit {100*hit:5.1f}%')
EOF
}

warmup() {  # a few requests (own seed, not reported) so page faults and lazy init are not timed
  "$KVRELAY" bench serve --url "http://127.0.0.1:$PORT" --rate inf --num-prompts 2 \
    --input-len "$IN" --output-len 4 --seed 999 >/dev/null
}

# run_load NAME RATE SEED [extra bench flags]. Each rate uses its own seed (other
# prompts), so a run never hits the prefix cache filled by the previous one;
# colocated and disaggregated see the same seeds, i.e. the same workload.
run_load() {
  local name=$1 rate=$2 seed=$3; shift 3
  "$KVRELAY" bench serve --url "http://127.0.0.1:$PORT" --rate "$rate" --num-prompts "$N" \
    --input-len "$IN" --output-len "$OUTLEN" --seed "$seed" --json "$OUT/$name-rate$rate.json" "$@" \
    >"$OUT/$name-rate$rate.txt"
  summary "$name" "$OUT/$name-rate$rate.json"
}

echo "# kvrelay cluster serving, $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "# N=$N input=$IN output=$OUTLEN; kv f16; 1 engine thread per worker"

start_cluster colocated --colocated "$COLOC" --prefill 0 --decode 0
warmup
seed=1; for r in $RATES; do run_load "colocated-x$COLOC" "$r" $seed; seed=$((seed + 1)); done
stop_cluster

start_cluster disagg --prefill 1 --decode 1
warmup
seed=1; for r in $RATES; do run_load "disagg-1p1d" "$r" $seed; seed=$((seed + 1)); done
stop_cluster

start_cluster disagg-tp2 --prefill 1 --decode 1 --tp 2
warmup
seed=1; for r in $RATES; do run_load "disagg-1p1d-tp2" "$r" $seed; seed=$((seed + 1)); done
stop_cluster

MID=$(echo "$RATES" | awk '{print $2 ? $2 : $1}')
for router in prefix_aware round_robin; do
  start_cluster "prefix-$router" --prefill 2 --decode 1 --router "$router"
  warmup
  run_load "shared-prefix-2p1d-$router" "$MID" 7 --shared-prefix "$SHARED" --prefix-groups "$NGROUPS"
  stop_cluster
done
