#!/usr/bin/env bash
# Cold time-to-first-token of one long prompt (default ~3,000 tokens), through
# the ./scripts/serve.sh topology (1 coordinator, 1 prefill worker, a decode
# group of TP 2; no prefix store, so every request is cold: each run uses a
# fresh random prompt) against llama-server on the same GGUF, alternating the
# two run by run. A benchmark, not a test.
#   bench/ttft_cold.sh [--reps 3] [--words 2950] [--prefill-threads N] [--threads T]
# --prefill-threads: the prefill worker's threads (default: nproc, as serve.sh;
# 1 reproduces the old topology); --threads: llama-server's threads (nproc).
# Prints one line per run and the medians.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=3 WORDS=2950 PT=$(nproc) LT=$(nproc)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --reps) REPS=$2; shift 2 ;;
    --words) WORDS=$2; shift 2 ;;
    --prefill-threads) PT=$2; shift 2 ;;
    --threads) LT=$2; shift 2 ;;
    *) echo "ttft_cold.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
# llama.cpp built natively (AMX off) by bench/build_llamacpp.sh unless LLAMA_SERVER names one.
LLAMA_SERVER=${LLAMA_SERVER:-$(bench/build_llamacpp.sh native)/llama-server}
OUT=${OUT:-/tmp/kvrelay-ttft}
mkdir -p "$OUT"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
KPORT=$(free_port) LPORT=$(free_port)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
wait_health() {  # wait_health PORT PID NAME
  for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "$3 exited; see $OUT/$3.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "$3 not healthy within 120 s" >&2; exit 1
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
build/cli/kvrelay launch --bin-dir build/bin --model "$MODEL" --prefill 1 --decode 1 --tp 2 \
  --port "$KPORT" --prefill-threads "$PT" --no-kv-store --kv-timeout-ms 120000 \
  >"$OUT/kvrelay.log" 2>&1 &
PIDS+=($!); wait_health "$KPORT" "${PIDS[-1]}" kvrelay
HAVE_LLAMA=0
if [[ -x $LLAMA_SERVER ]]; then
  "$LLAMA_SERVER" -m "$MODEL" --port "$LPORT" -t "$LT" -c 8192 -np 1 --no-warmup \
    >"$OUT/llama.log" 2>&1 &
  PIDS+=($!); wait_health "$LPORT" "${PIDS[-1]}" llama; HAVE_LLAMA=1
fi
# ttft PORT SEED: seconds to the first streamed token of a fresh prompt.
ttft() {
  python3 - "$1" "$2" "$WORDS" <<'PY'
import json, random, sys, time, urllib.request
port, seed, words = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
vocab = ("time river stone light green market number quiet north window paper "
         "garden silver engine morning letter bridge winter story circle").split()
prompt = " ".join(rng.choice(vocab) for _ in range(words)) + "\nSummarise the text above."
with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
    model = json.load(r)["data"][0]["id"]
body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "stream": True,
                   "temperature": 0}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                             {"Content-Type": "application/json"})
t0 = time.perf_counter()
with urllib.request.urlopen(req, timeout=600) as r:
    for line in r:
        line = line.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            d = json.loads(line[5:])
            if d.get("choices") and d["choices"][0].get("text"):
                print(f"{time.perf_counter() - t0:.3f}")
                break
PY
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ks=(); ls=()
echo "prompt ~$WORDS words, kvrelay prefill threads $PT, llama-server threads $LT, $REPS runs each"
for ((i = 1; i <= REPS; i++)); do
  ks+=("$(ttft "$KPORT" "$((1000 + i))")")
  line="run $i: kvrelay ${ks[-1]} s"
  if [[ $HAVE_LLAMA == 1 ]]; then
    ls+=("$(ttft "$LPORT" "$((2000 + i))")"); line+=" | llama-server ${ls[-1]} s"
  fi
  echo "$line"
done
km=$(printf '%s\n' "${ks[@]}" | median)
if [[ $HAVE_LLAMA == 1 ]]; then
  lm=$(printf '%s\n' "${ls[@]}" | median)
  awk -v a="$km" -v b="$lm" 'BEGIN {printf "median cold TTFT: kvrelay %.2f s, llama-server %.2f s, ratio llama/kvrelay %.2f\n", a, b, b / a}'
else
  echo "median cold TTFT: kvrelay $km s (no llama-server at $LLAMA_SERVER)"
fi
