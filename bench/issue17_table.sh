#!/usr/bin/env bash
# The whole issue #17 table in one run, side by side with llama.cpp's own
# tools (not a test; about 12-15 minutes on a quiet 2-core machine, every
# section bounded by a timeout so the run ends within ~15 minutes):
#   1-3. prompt processing pp512 / pp2048 / pp4096 and generation (tg) vs
#        llama-bench                           bench/compare_llamacpp.sh
#   4.   batched decode, batch 64 vs batch 1   kvrelay bench engine --batches 1,64
#   5.   decode at 4,096 positions of context  kvrelay bench engine --context 4096
#   6.   generation with one competing busy process / idle, kvrelay and llama-bench
#   7.   cold TTFT of a ~3,000-token prompt, serve.sh topology vs llama-server
#                                              bench/ttft_cold.sh
#   8.   saturated serving, serve.sh topology vs llama-server
#                                              bench/serve_saturated.sh
# Needs build/cli/kvrelay and build/bin (a Release build); llama.cpp's tools are
# built by bench/build_llamacpp.sh when missing. Logs go to $OUT (default
# /tmp/kvrelay-issue17).
#
#   bench/issue17_table.sh [--threads T] [--quick] [--avx2]
# --quick: one repetition per measure (a smoke run of the script, ~6 minutes).
# --avx2: the AVX2-only machine's table on this one: kvrelay forced to its AVX2
#         kernels (KVRELAY_KERNELS=avx2, inherited by every process it starts)
#         against llama.cpp built for AVX2 (bench/build_llamacpp.sh avx2).
set -uo pipefail
cd "$(dirname "$0")/.."

T=$(nproc) REPS=3 QUICK=0 ONLY="" FLAVOR=native
while [[ $# -gt 0 ]]; do
  case "$1" in
    --threads) T=$2; shift 2 ;;
    --quick) QUICK=1; REPS=1; shift ;;
    --avx2) FLAVOR=avx2; shift ;;
    --reps) REPS=$2; shift 2 ;;               # internal: the contention section
    --only-contention) ONLY=contention; shift ;;
    *) echo "issue17_table.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/kvrelay-issue17}
mkdir -p "$OUT"
KV=build/cli/kvrelay
[[ $FLAVOR == avx2 ]] && export KVRELAY_KERNELS=avx2
LLAMA_BIN=$(bench/build_llamacpp.sh "$FLAVOR") || { echo "issue17_table.sh: llama.cpp build failed" >&2; exit 1; }
LLAMA_BENCH=$LLAMA_BIN/llama-bench
export LLAMA_SERVER=$LLAMA_BIN/llama-server  # bench/ttft_cold.sh, bench/serve_saturated.sh
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -x $KV ]] || { echo "issue17_table.sh: build/cli/kvrelay missing (scripts/build.sh build)" >&2; exit 1; }
START=$(date +%s)
median() { sort -g | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "nan"}'; }
# Generation alone and beside one busy process, alternating, kvrelay and llama-bench.
contention() {
  local k_idle=() k_busy=() l_idle=() l_busy=()
  # The busy process never outlives this section (timeout sends TERM).
  BUSY=""
  trap '[[ -n $BUSY ]] && kill "$BUSY" 2>/dev/null; exit 1' TERM INT
  trap '[[ -n $BUSY ]] && kill "$BUSY" 2>/dev/null' EXIT
  kv_tg() { "$KV" bench engine --threads "$T" --reps 1 --pp 16 --tg 64 --skip-batches | awk '$1=="tg64"{print $2}'; }
  ll_tg() {
    "$LLAMA_BENCH" -m "$MODEL" -t "$T" -p 0 -n 64 -r 1 -o json 2>/dev/null |
      python3 -c 'import json,sys; print("%.2f" % json.load(sys.stdin)[0]["avg_ts"])'
  }
  for ((i = 1; i <= REPS; i++)); do
    k_idle+=("$(kv_tg)")
    [[ -x $LLAMA_BENCH ]] && l_idle+=("$(ll_tg)")
    sh -c 'while :; do :; done' &
    BUSY=$!
    k_busy+=("$(kv_tg)")
    [[ -x $LLAMA_BENCH ]] && l_busy+=("$(ll_tg)")
    kill "$BUSY"; wait "$BUSY" 2>/dev/null; BUSY=""
    echo "round $i: kvrelay idle ${k_idle[-1]} busy ${k_busy[-1]} | llama.cpp idle ${l_idle[-1]:-} busy ${l_busy[-1]:-}"
  done
  local ki kb li lb
  ki=$(printf '%s\n' "${k_idle[@]}" | median); kb=$(printf '%s\n' "${k_busy[@]}" | median)
  awk -v a="$kb" -v b="$ki" 'BEGIN {printf "contention kvrelay tg64 busy/idle %.2f / %.2f = %.2f\n", a, b, a / b}'
  if [[ ${#l_idle[@]} -gt 0 ]]; then
    li=$(printf '%s\n' "${l_idle[@]}" | median); lb=$(printf '%s\n' "${l_busy[@]}" | median)
    awk -v a="$lb" -v b="$li" 'BEGIN {printf "contention llama.cpp tg64 busy/idle %.2f / %.2f = %.2f\n", a, b, a / b}'
  fi
}
if [[ $ONLY == contention ]]; then contention; exit 0; fi

SECTION_PID=""
trap '[[ -n $SECTION_PID ]] && kill -TERM "$SECTION_PID" 2>/dev/null; exit 130' TERM INT
# section NAME TIMEOUT_S CMD...: runs CMD under a timeout, log in $OUT/NAME.log.
section() {
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  echo
  echo "== $name ($(date -u +%H:%M:%S) UTC, limit ${limit}s)"
  # In the background so a TERM / Ctrl-C of this script reaches the section
  # (timeout forwards it to the section's whole process group).
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 &
  SECTION_PID=$!
  wait "$SECTION_PID"
  local rc=$?
  SECTION_PID=""
  [[ $rc == 124 || $rc == 137 ]] && echo "   (timed out after ${limit}s: partial results)"
  [[ $rc != 0 && $rc != 124 && $rc != 137 ]] && echo "   (exit status $rc; see $OUT/$name.log)"
  echo "   [$(($(date +%s) - t0)) s]"
  return 0
}

echo "# issue #17 table ($FLAVOR llama.cpp build), $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "$(nproc) cores, threads $T, kernels $($KV bench engine --threads 1 --reps 1 --pp 16 --tg 1 \
  --skip-batches 2>/dev/null | sed -n 's/.*kernels \([a-z0-9]*\).*/\1/p')"
echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

section pp512_tg128 150 bench/compare_llamacpp.sh --llama-build "$FLAVOR" --threads "$T" --reps "$REPS" --pp 512 --tg 128
grep -E "^(pp|tg)[0-9]" "$OUT/pp512_tg128.log"
section pp2048 200 bench/compare_llamacpp.sh --llama-build "$FLAVOR" --threads "$T" --reps "$REPS" --pp 2048 --tg 16
grep -E "^pp[0-9]" "$OUT/pp2048.log"
section pp4096 240 bench/compare_llamacpp.sh --llama-build "$FLAVOR" --threads "$T" --reps $((REPS > 1 ? 2 : 1)) --pp 4096 --tg 16
grep -E "^pp[0-9]" "$OUT/pp4096.log"

section batched_decode 90 "$KV" bench engine --threads "$T" --reps "$REPS" --pp 16 --tg 1 \
  --batches 1,64 --batch-steps 16
grep -E "^decode batch|vs batch 1" "$OUT/batched_decode.log" | tail -4

section long_context_decode 120 "$KV" bench engine --threads "$T" --reps 1 --pp 16 --tg 1 \
  --batches 1 --batch-steps 16 --context 4096
grep -E "^decode batch 1" "$OUT/long_context_decode.log" | tail -1 | sed 's/^/context 4096: /'

section contention 150 "$0" --only-contention --threads "$T" --reps "$REPS" \
  $([[ $FLAVOR == avx2 ]] && echo --avx2)
grep -E "^contention" "$OUT/contention.log"

section ttft_cold 240 bench/ttft_cold.sh --reps "$REPS"
grep -E "^median cold TTFT" "$OUT/ttft_cold.log"

section serve_saturated 200 bench/serve_saturated.sh --prompts $((QUICK ? 16 : 48))
grep -E "^(##|throughput|TTFT|ratio)" "$OUT/serve_saturated.log"

echo
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg); total $(($(date +%s) - START)) s"
