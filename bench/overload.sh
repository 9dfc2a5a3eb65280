#!/usr/bin/env bash
# Goodput under overload (issue #14): a `kvrelay launch` cluster (1 prefill +
# 1 decode by default) driven by `kvrelay bench serve`: closed loops first to
# find the peak, then open loops at 1x, 2x and 4x the saturation rate, once
# with admission control shedding early (--max-running R --max-queue-delay-ms
# Q: 429 + Retry-After when the predicted queue wait passes Q) and once with
# the coordinator's defaults (64 running, a 2 s bound on the predicted time to
# the first token) for comparison.
#
# Goodput = requests whose TTFT met --ttft-slo-ms and whose first token came
# while the load was on, per second of the span their arrivals covered
# (bench/overload_report.py; the whole-run figure, good / duration, is printed
# too). The runs must be long against the deadline (-n 150: ~11 s of arrivals
# per level vs a 5 s deadline), or a burst queues inside the deadline. Peak goodput = the best goodput of closed loops
# of C clients, C in -c, on a cluster with the coordinator's defaults but no
# early shedding (a closed loop of C keeps C requests in flight without queueing: what the
# cluster sustains at that concurrency); saturation = that loop's request
# rate, and `-r auto` (the default) gives the shedding config that C as
# --max-running. The open loops offer 1x/2x/4x the saturation rate, -n x the
# multiplier requests each (every level runs about as long), the same rates
# for every config. On a shared machine the capacity drifts between runs, so
# each config's "of peak" is against a closed loop of that C run in the same
# cluster just before and just after its open loops (the larger of the two).
#
#   bench/overload.sh [-n prompts-at-1x] [-r max-running] [-q max-queue-delay-ms]
#                     [-s ttft-slo-ms] [-i input-len] [-o output-len] [-m "1 2 4"]
#                     [-c "2 4 8 16"] [-P prefill] [-D decode] [-O out-dir] [-x "defaults shed"]
# Prints one table, then "goodput_vs_peak CONFIG Mx FRACTION" per config and
# load; the JSON of every run is kept in out-dir (default out/overload).
# `bench/report.py record overload OUT-DIR --slo-ms S --label L` adds the
# defaults' run to docs/BENCHMARKS.md's goodput table (then `render`).
set -euo pipefail
cd "$(dirname "$0")/.."

N=150 R=auto Q=2000 SLO=5000 IN=64 OUT=16 MULT="1 2 4" CONC="2 4 8 16" P=1 D=1 OUTDIR=out/overload
CONFIGS="defaults shed"
while getopts "n:r:q:s:i:o:m:c:P:D:O:x:" opt; do
  case $opt in
    n) N=$OPTARG ;; r) R=$OPTARG ;; q) Q=$OPTARG ;; s) SLO=$OPTARG ;; i) IN=$OPTARG ;;
    o) OUT=$OPTARG ;; m) MULT=$OPTARG ;; c) CONC=$OPTARG ;; P) P=$OPTARG ;; D) D=$OPTARG ;;
    O) OUTDIR=$OPTARG ;; x) CONFIGS=$OPTARG ;;
    *) echo "usage: $0 [-n N] [-r max-running] [-q max-queue-delay-ms] [-s ttft-slo-ms]" \
            "[-i input-len] [-o output-len] [-m multipliers] [-c concurrencies] [-P prefill]" \
            "[-D decode] [-O dir] [-x configs]" >&2
       exit 2 ;;
  esac
done
REPORT=bench/overload_report.py
KVRELAY=build/cli/kvrelay
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -x "$KVRELAY" ] || { echo "overload.sh: build $KVRELAY first" >&2; exit 2; }
[ -f "$MODEL" ] || { echo "overload.sh: $MODEL missing (scripts/fetch-model.sh)" >&2; exit 2; }
mkdir -p "$OUTDIR"

launcher=""
stop_cluster() {
  [ -n "$launcher" ] || return 0
  kill -TERM "$launcher" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$launcher" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$launcher" 2>/dev/null || true
  wait "$launcher" 2>/dev/null || true
  launcher=""
}
trap stop_cluster EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start_cluster NAME [launch flags...]: starts it, waits for its banner (deadline 180 s).
start_cluster() {
  local name=$1; shift
  PORT=$(free_port)
  : >"$OUTDIR/$name.launch.log"
  "$KVRELAY" launch --prefill "$P" --decode "$D" --no-kv-store --port "$PORT" \
    --threads-per-worker 1 --kv-dtype f32 "$@" >"$OUTDIR/$name.launch.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 1800); do
    grep -q "kvrelay cluster serving on" "$OUTDIR/$name.launch.log" && return 0
    kill -0 "$launcher" 2>/dev/null || { cat "$OUTDIR/$name.launch.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "overload.sh: cluster $name not ready in 180 s" >&2
  exit 1
}

bench() {  # bench JSON-OUT [bench serve flags...]
  local out=$1; shift
  "$KVRELAY" bench serve --url "http://127.0.0.1:$PORT" --input-len "$IN" --output-len "$OUT" \
    --ttft-slo-ms "$SLO" --timeout-s 120 --json "$out" "$@" >"$out.txt" 2>&1 || true
}

PEAK="" SAT="" BEST_C=""
# measure_peak: closed loops of C clients on the running cluster; the best
# goodput, its request rate and its C.
measure_peak() {
  local name=$1 best=0 best_rate=0 best_c="" c g rt
  for c in $CONC; do
    bench "$OUTDIR/$name.closed$c.json" --rate inf --num-prompts $((c * 8)) --max-concurrency "$c" --seed $((1 + c))
    g=$(python3 "$REPORT" window "$OUTDIR/$name.closed$c.json" "$SLO")
    rt=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['request_throughput'])" \
         "$OUTDIR/$name.closed$c.json")
    echo "overload.sh: closed loop of $c clients: goodput $g req/s, throughput $rt req/s"
    if python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) > float(sys.argv[2]) else 1)" "$g" "$best"; then
      best=$g best_rate=$rt best_c=$c
    fi
  done
  PEAK=$best SAT=$best_rate BEST_C=$best_c
  echo "overload.sh: peak goodput $PEAK req/s (closed loop of $BEST_C), saturation $SAT req/s"
}

run_config() {  # run_config NAME [launch flags...]
  local name=$1; shift
  start_cluster "$name" "$@"
  bench "$OUTDIR/$name.warmup.json" --rate inf --num-prompts 4 --max-concurrency 2 --seed 99
  # The reference closed loops around the open ones (see the header).
  bench "$OUTDIR/$name.peak-before.json" --rate inf --num-prompts $((BEST_C * 8)) --max-concurrency "$BEST_C" --seed 7
  for m in $MULT; do
    rate=$(python3 -c "print(round($SAT * $m, 3))")
    bench "$OUTDIR/$name.x$m.json" --rate "$rate" --num-prompts $((N * m)) --max-concurrency 1024 --seed $((10 + m))
  done
  bench "$OUTDIR/$name.peak-after.json" --rate inf --num-prompts $((BEST_C * 8)) --max-concurrency "$BEST_C" --seed 8
  stop_cluster
}

date -u +"overload.sh: %Y-%m-%dT%H:%M:%SZ on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs"
# The peak is measured with no early shedding: a closed loop whose refused
# requests come back at once would measure the refusals, not the cluster.
start_cluster peak --max-queue-delay-ms 0
bench "$OUTDIR/peak.warmup.json" --rate inf --num-prompts 4 --max-concurrency 2 --seed 99
measure_peak peak
stop_cluster
for c in defaults shed; do
  case " $CONFIGS " in *" $c "*) ;; *) continue ;; esac
  if [ "$c" = defaults ]; then
    run_config defaults
  else
    [ "$R" = auto ] && R=$BEST_C
    run_config shed --max-running "$R" --max-queue-delay-ms "$Q"
  fi
done
[ "$R" = auto ] && R=$BEST_C
python3 "$REPORT" table "$OUTDIR" "$MULT" "$SLO" "$R" "$Q" "$PEAK" "$SAT" "$CONFIGS" "$BEST_C"
