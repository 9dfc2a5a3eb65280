#!/usr/bin/env bash
# Goodput under overload (issue #14): a `kvrelay launch` cluster (1 prefill +
# 1 decode by default) driven by `kvrelay bench serve` at 1x, 2x and 4x its
# measured saturation rate, once with admission control shedding early
# (--max-running R --max-queue-delay-ms Q: 429 + Retry-After when the
# predicted queue wait passes Q) and once with the coordinator's defaults
# (64 running, no delay bound) for comparison.
#
# Saturation = the request throughput of a closed loop of R clients. Goodput of
# the admitted = requests whose TTFT met --ttft-slo-ms / requests not shed.
#
#   bench/overload.sh [-n prompts-per-rate] [-r max-running] [-q max-queue-delay-ms]
#                     [-s ttft-slo-ms] [-i input-len] [-o output-len] [-m "1 2 4"]
#                     [-P prefill] [-D decode] [-O out-dir]
# Prints one table; the JSON of every run is kept in out-dir (default out/overload).
set -euo pipefail
cd "$(dirname "$0")/.."

N=48 R=4 Q=2000 SLO=5000 IN=64 OUT=16 MULT="1 2 4" P=1 D=1 OUTDIR=out/overload
while getopts "n:r:q:s:i:o:m:P:D:O:" opt; do
  case $opt in
    n) N=$OPTARG ;; r) R=$OPTARG ;; q) Q=$OPTARG ;; s) SLO=$OPTARG ;; i) IN=$OPTARG ;;
    o) OUT=$OPTARG ;; m) MULT=$OPTARG ;; P) P=$OPTARG ;; D) D=$OPTARG ;; O) OUTDIR=$OPTARG ;;
    *) echo "usage: $0 [-n N] [-r max-running] [-q max-queue-delay-ms] [-s ttft-slo-ms]" \
            "[-i input-len] [-o output-len] [-m multipliers] [-P prefill] [-D decode] [-O dir]" >&2
       exit 2 ;;
  esac
done
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

run_config() {  # run_config NAME [launch flags...]
  local name=$1; shift
  start_cluster "$name" "$@"
  bench "$OUTDIR/$name.warmup.json" --rate inf --num-prompts 4 --max-concurrency 2 --seed 99
  # Saturation: a closed loop of R clients.
  bench "$OUTDIR/$name.saturation.json" --rate inf --num-prompts $((R * 4)) --max-concurrency "$R" --seed 1
  SAT=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['request_throughput'])" \
        "$OUTDIR/$name.saturation.json")
  for m in $MULT; do
    rate=$(python3 -c "print(round($SAT * $m, 3))")
    bench "$OUTDIR/$name.x$m.json" --rate "$rate" --num-prompts "$N" --max-concurrency 512 --seed $((10 + m))
  done
  stop_cluster
}

date -u +"overload.sh: %Y-%m-%dT%H:%M:%SZ on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs"
run_config shed --max-running "$R" --max-queue-delay-ms "$Q"
run_config defaults

python3 - "$OUTDIR" "$MULT" "$SLO" "$R" "$Q" <<'EOF'
import json, statistics, sys
out, mult, slo, r, q = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4], sys.argv[5]
print(f"TTFT deadline {slo} ms; shed = --max-running {r} --max-queue-delay-ms {q}; "
      "defaults = --max-running 64, no delay bound")
print("| config | load | offered req/s | requests | shed (429/503 + Retry-After) | median time to refusal | "
      "failed | met deadline | goodput of admitted | TTFT p50 / p90 of completed |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name in ("shed", "defaults"):
    for m in mult:
        try:
            j = json.load(open(f"{out}/{name}.x{m}.json"))
        except (OSError, ValueError):
            print(f"| {name} | {m}x | (run failed: see {out}/{name}.x{m}.json.txt) |")
            continue
        reqs = j["requests"]
        refused = [x["e2e_ms"] for x in reqs if not x["ok"] and x.get("retry_after")
                   and x.get("http_status") in (429, 503)]
        admitted = len(reqs) - len(refused)
        good = j["good_requests"]
        failed = j["failed"] - len(refused)
        med = f"{statistics.median(refused):.0f} ms" if refused else "-"
        gp = f"{100.0 * good / admitted:.0f}%" if admitted else "-"
        print(f"| {name} | {m}x | {j['rate']:.2f} | {len(reqs)} | {len(refused)} | {med} | {failed} | "
              f"{good} | {gp} | {j['ttft_ms']['p50']:.0f} / {j['ttft_ms']['p90']:.0f} ms |")
EOF
