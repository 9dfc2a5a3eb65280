#!/usr/bin/env bash
# Saturated serving throughput (not a test): the serve.sh topology (1 prefill
# worker with every core, 1 decode group of TP = 2, prefix store off so every
# prompt is cold) against llama-server on the same GGUF and cores, each loaded
# with the same `kvrelay bench serve` workload: N random-token prompts of
# --input-len tokens, 32-token answers, all submitted at once (--rate inf) with
# at most C in flight. Prints each server's summary and the ratios
# (kvrelay / llama-server output tok/s; p99 TTFT).
#
#   bench/serve_saturated.sh [--prompts 48] [--input-len 128] [--output-len 32]
#                            [--concurrency 32] [--slots 16] [--threads T]
#
# llama-server: LLAMA_SERVER, else built natively by bench/build_llamacpp.sh
# (bench/compare_llamacpp.sh builds it); without it only kvrelay runs.
set -euo pipefail
cd "$(dirname "$0")/.."

N=48 IN=128 OUTLEN=32 CONC=32 SLOTS=16 LT=$(nproc)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prompts) N=$2; shift 2 ;;
    --input-len) IN=$2; shift 2 ;;
    --output-len) OUTLEN=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --slots) SLOTS=$2; shift 2 ;;
    --threads) LT=$2; shift 2 ;;
    *) echo "serve_saturated.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
# llama.cpp built natively (AMX off) by bench/build_llamacpp.sh unless LLAMA_SERVER names one.
LLAMA_SERVER=${LLAMA_SERVER:-$(bench/build_llamacpp.sh native)/llama-server}
OUT=${OUT:-/tmp/kvrelay-saturated}
mkdir -p "$OUT"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PID=""
stop() {
  if [[ -n $PID ]]; then
    kill -TERM "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=""
  fi
}
trap stop EXIT
wait_health() {  # wait_health PORT NAME
  for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
    kill -0 "$PID" 2>/dev/null || { echo "$2 exited; see $OUT/$2.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "$2 not healthy within 120 s" >&2; exit 1
}
# load PORT NAME: two untimed requests, then the timed saturated run.
load() {
  build/cli/kvrelay bench serve --url "http://127.0.0.1:$1" --rate inf --num-prompts 2 \
    --input-len "$IN" --output-len "$OUTLEN" --seed 99 >/dev/null
  build/cli/kvrelay bench serve --url "http://127.0.0.1:$1" --rate inf --num-prompts "$N" \
    --input-len "$IN" --output-len "$OUTLEN" --max-concurrency "$CONC" --seed 1 \
    --json "$OUT/$2.json" | tee "$OUT/$2.txt" | grep -E "^(completed|throughput|TTFT|TPOT)"
}

echo "# saturated serving, $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
echo "# $N prompts x $IN tokens, $OUTLEN-token answers, rate inf, at most $CONC in flight"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
KPORT=$(free_port)
build/cli/kvrelay launch --bin-dir build/bin --model "$MODEL" --prefill 1 --decode 1 --tp 2 \
  --port "$KPORT" --prefill-threads "$(nproc)" --no-kv-store >"$OUT/kvrelay.log" 2>&1 &
PID=$!
wait_health "$KPORT" kvrelay
echo "## kvrelay (serve.sh topology)"
load "$KPORT" kvrelay
stop
if [[ -x $LLAMA_SERVER ]]; then
  LPORT=$(free_port)
  "$LLAMA_SERVER" -m "$MODEL" --port "$LPORT" -t "$LT" -np "$SLOTS" -c $((SLOTS * 512)) \
    --no-warmup >"$OUT/llama.log" 2>&1 &
  PID=$!
  wait_health "$LPORT" llama
  echo "## llama-server ($SLOTS slots, $LT threads)"
  load "$LPORT" llama
  stop
  python3 - "$OUT/kvrelay.json" "$OUT/llama.json" <<'PY'
import json, sys
k, l = (json.load(open(p)) for p in sys.argv[1:3])
kt, lt = k["output_token_throughput"], l["output_token_throughput"]
kp, lp = k["ttft_ms"]["p99"], l["ttft_ms"]["p99"]
print(f"ratio output tok/s kvrelay / llama-server: {kt / lt:.2f} ({kt:.1f} / {lt:.1f}); "
      f"p99 TTFT kvrelay {kp:.0f} ms, llama-server {lp:.0f} ms")
PY
else
  echo "(no llama-server at $LLAMA_SERVER)"
fi
