#!/usr/bin/env bash
# TTFT of short and long prompts at a low request rate through the
# ./scripts/serve.sh topology (1 coordinator, 1 prefill worker, a decode
# group of TP 2), for two builds side by side in one run, alternating A and
# B round by round: e.g. main before a change (A) against the working tree
# (B). The client is `kvrelay bench serve` of build/. A benchmark, not a test.
#   bench/ttft_ab.sh --a-cli DIR/kvrelay --a-bin DIR/bin [--rounds 2]
#                    [--short-prompts 20] [--long-prompts 4]
# B is build/cli/kvrelay with build/bin. Per round and build: --short-prompts
# ~100-token prompts at 0.5 req/s, then --long-prompts ~3,000-token prompts
# one at a time (a cold one takes ~4 s to prefill on 2 cores), 16 output
# tokens each, no prefix reuse (random prompts, no prefix store: its disk
# writes share the 2 cores and blur the path being compared). Prints each run's TTFT p50/p90 and, where the build exports
# kvrelay_control_messages_total, the control messages per request by type.
set -euo pipefail
cd "$(dirname "$0")/.."
A_CLI="" A_BIN="" ROUNDS=2 NSHORT=20 NLONG=4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --a-cli) A_CLI=$2; shift 2 ;;
    --a-bin) A_BIN=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --short-prompts) NSHORT=$2; shift 2 ;;
    --long-prompts) NLONG=$2; shift 2 ;;
    *) echo "ttft_ab.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
[[ -x $A_CLI && -d $A_BIN ]] || { echo "ttft_ab.sh: --a-cli and --a-bin are required" >&2; exit 2; }
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
CLIENT=build/cli/kvrelay
OUT=$(mktemp -d /tmp/kvrelay-ttft-ab.XXXXXX)
PID=""
cleanup() { [[ -n $PID ]] && { kill -TERM "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; }; PID=""; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# run NAME CLI BIN ROUND
run() {
  local name=$1 cli=$2 bin=$3 round=$4 port; port=$(free_port)
  "$cli" launch --bin-dir "$bin" --model "$MODEL" --prefill 1 --decode 1 --tp 2 --port "$port" \
    --prefill-threads "$(nproc)" --no-kv-store --kv-timeout-ms 120000 \
    >"$OUT/$name-$round.log" 2>&1 &
  PID=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$PID" 2>/dev/null || { echo "$name exited; see $OUT/$name-$round.log" >&2; exit 1; }
    sleep 0.5
  done
  for kind in short long; do
    local n=$NSHORT len=100 rate=0.5 conc=4
    [[ $kind == long ]] && { n=$NLONG; len=3000; rate=1; conc=1; }
    "$CLIENT" bench serve --url "http://127.0.0.1:$port" --rate "$rate" --num-prompts "$n" \
      --input-len "$len" --output-len 16 --seed "$round" --max-concurrency "$conc" \
      --json "$OUT/$name-$round-$kind.json" >"$OUT/$name-$round-$kind.txt"
    python3 - "$OUT/$name-$round-$kind.json" "$name" "$round" "$kind" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
t = r["ttft_ms"]
print(f"{sys.argv[2]:>6} round {sys.argv[3]} {sys.argv[4]:>5}: TTFT p50 {t['p50']:8.1f} ms  p90 {t['p90']:8.1f} ms  ({r['completed']} requests)")
PY
  done
  curl -sf "http://127.0.0.1:$port/metrics" >"$OUT/$name-$round.metrics" || true
  python3 - "$OUT/$name-$round.metrics" $((NSHORT + NLONG)) <<'PY'
import re, sys
n = int(sys.argv[2])
counts = {}
for line in open(sys.argv[1]):
    m = re.match(r'kvrelay_control_messages_total\{(.*)\} (\S+)', line)
    if not m: continue
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    if labels["type"] in ("Heartbeat", "PrefixCacheEvent", "RegisterWorker", "RegisterReply", "HelloReply", "Hello", "AuthProof", "AuthChallenge", "AuthHello"):
        continue
    counts[(labels["direction"], labels["type"])] = float(m.group(2))
if counts:
    per = ", ".join(f"{d} {t} {v / n:.2f}" for (d, t), v in sorted(counts.items()))
    print(f"        control messages per request: {per}; total {sum(counts.values()) / n:.2f}")
PY
  cleanup
}
echo "date $(date -u +%FT%TZ), CPU $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, A = $A_CLI, B = build/"
for round in $(seq 1 "$ROUNDS"); do
  run A "$A_CLI" "$A_BIN" "$round"
  run B "$CLIENT" build/bin "$round"
done
echo "runs and logs: $OUT"
