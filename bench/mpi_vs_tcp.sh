#!/usr/bin/env bash
# MPI vs TCP inside the cluster (a benchmark, not a test): the same mpirun
# launch (deploy/mpirun/launch.sh, 1 prefill + 1 decode group of TP = 2, on
# this machine), the same `kvrelay bench serve` workload, with
#   mpi/mpi  KV data plane MPI, TP collectives on the MPI sub-communicator
#   mpi/tcp  KV data plane MPI, TP collectives on the TCP star link
#   tcp/tcp  both over TCP
# Reports TPOT/TTFT percentiles and, from the workers' transfer counters, the
# prefill->decode KV transfer time per request that compute did not hide: the
# prefill side's wait for its streams after the last layer, plus the decode
# side's wait from the first token to verified KV. Rounds alternate the configs.
#   bench/mpi_vs_tcp.sh [-b build-dir] [-r rounds] [-n prompts] [-R rate]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build ROUNDS=2 N=16 RATE=1 IN=256 OUTLEN=32
while getopts "b:r:n:R:" o; do
  case $o in b) BUILD=$OPTARG ;; r) ROUNDS=$OPTARG ;; n) N=$OPTARG ;; R) RATE=$OPTARG ;; *) exit 2 ;; esac
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
KVRELAY=$BUILD/cli/kvrelay
OUT=$(mktemp -d)
PORT=18080 CONTROL=19000
pid=""
cleanup() { [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; rm -rf "$OUT"; }
trap cleanup EXIT

metric_sum() {  # sum of a worker counter over every worker
  curl -s "http://127.0.0.1:$PORT/metrics" | awk -v n="$1" 'index($0, n"{") == 1 {s += $NF} END {printf "%.6f", s}'
}

run() {  # run NAME KV TPCOMM ROUND
  local name=$1 kv=$2 tp=$3 round=$4
  deploy/mpirun/launch.sh -P 1 -D 1 -T 2 -p $PORT -C $CONTROL -b "$BUILD/bin" -t 1 -X "$kv" -M "$tp" \
    >"$OUT/${name//\//-}-$round.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 0.2
  done
  "$KVRELAY" bench serve --url "http://127.0.0.1:$PORT" --rate inf --num-prompts 2 --input-len "$IN" \
    --output-len 4 --seed 999 >/dev/null
  local s0 b0
  s0=$(metric_sum kvrelay_worker_transfer_seconds_total)
  "$KVRELAY" bench serve --url "http://127.0.0.1:$PORT" --rate "$RATE" --num-prompts "$N" \
    --input-len "$IN" --output-len "$OUTLEN" --seed $((round + 1)) --json "$OUT/${name//\//-}-$round.json" >/dev/null
  sleep 1.5  # one more heartbeat carries the last counters
  local s1
  s1=$(metric_sum kvrelay_worker_transfer_seconds_total)
  python3 - "$name" "$OUT/${name//\//-}-$round.json" "$s0" "$s1" "$N" <<'PY'
import json, sys
name, path, s0, s1, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
r = json.load(open(path))
print(f'{name:8} ok {r["completed"]:>2}/{r["num_prompts"]:<2} TPOT p50 {r["tpot_ms"]["p50"]:6.1f} p90 {r["tpot_ms"]["p90"]:6.1f} ms  '
      f'TTFT p50 {r["ttft_ms"]["p50"]:7.1f} ms  KV transfer {1e3 * (s1 - s0) / max(1, r["completed"]):6.2f} ms/request '
      f'(not hidden behind the prefill)')
PY
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=""
}

echo "# kvrelay MPI vs TCP, $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
echo "# launch.sh -P 1 -D 1 -T 2 -t 1; bench serve --rate $RATE --num-prompts $N --input-len $IN --output-len $OUTLEN"
for round in $(seq 1 "$ROUNDS"); do
  run mpi/mpi mpi mpi "$round"
  [ -z "${ONLY_MPI:-}" ] && run mpi/tcp mpi tcp "$round"
  [ -z "${ONLY_MPI:-}" ] && run tcp/tcp tcp tcp "$round"
done
