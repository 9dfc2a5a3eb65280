#!/usr/bin/env bash
# The prefix store across a full restart (issue 15), through the cluster that
# scripts/serve.sh starts, with the official `openai` client:
#   1. cold:    a ~3,000-token system prompt + question A (nothing cached)
#   2. ram:     the same system prompt + question B (pool hit, for reference)
#   3. restart: the cluster is stopped (SIGINT, workers drain their store) and
#               started again on the same store directory
#   4. restart: the same system prompt + question C (restored from RocksDB)
# Reports TTFT of each phase, the speedup cold -> after restart and
# cached_tokens / prompt_tokens. PREFIXES=10 runs 10 different system prompts
# in each phase (larger together than the default 256 MB KV pool).
#
# usage: bench/prefix_restart.sh   (env: PORT=8090 PREFIXES=1 OUT=out/prefix_restart WARMUP=0)
# WARMUP=1 serves one short request of another prompt after the restart, before
# phase 4, so that it measures the restore alone.
# Writes $OUT/results.jsonl and prints a Markdown table; `bench/report.py record
# prefix_restart $OUT` adds the run to docs/BENCHMARKS.md's table (then `render`).
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8090}
PREFIXES=${PREFIXES:-1}
WARMUP=${WARMUP:-0}
OUT=${OUT:-out/prefix_restart}
STORE="$OUT/kvstore"
VENV=${KVRELAY_OPENAI_VENV:-openai-venv}
mkdir -p "$OUT"
rm -rf "$STORE" "$OUT/results.jsonl"

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import openai" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q openai
fi

SERVE_PID=""
stop_cluster() {
  if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
    kill -INT "$SERVE_PID"
    # The launcher gives workers 15 s after SIGTERM to drain the store.
    for _ in $(seq 1 300); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVE_PID" 2>/dev/null || true
    wait "$SERVE_PID" 2>/dev/null || true
  fi
  SERVE_PID=""
}
trap stop_cluster EXIT

start_cluster() {  # start_cluster LOGNAME
  # On a shared 2-core machine a cold 3,000-token prefill can outlast the decode
  # worker's default 30 s wait for the KV (--kv-timeout-ms), and one layer of a
  # 512-token chunk can outlast 3 heartbeats of 500 ms (--heartbeat-ms; longer
  # heartbeats make the coordinator's view of free decode blocks staler, so
  # prefix_restart.py retries a 503 "no decode worker has room").
  ./scripts/serve.sh --port "$PORT" --kv-store "$STORE" --kv-timeout-ms 600000 \
    --heartbeat-ms 1000 \
    >"$OUT/$1.log" 2>&1 &
  SERVE_PID=$!
  for _ in $(seq 1 3000); do  # up to 300 s (serve.sh may build first)
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVE_PID" 2>/dev/null; then
      echo "cluster exited; see $OUT/$1.log" >&2; tail -20 "$OUT/$1.log" >&2; exit 1
    fi
    sleep 0.1
  done
  echo "cluster not healthy after 300 s; see $OUT/$1.log" >&2; exit 1
}

phase() {  # phase NAME QUESTION_SEED
  local model
  model=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | "$VENV/bin/python" -c \
    'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  "$VENV/bin/python" bench/prefix_restart.py "http://127.0.0.1:$PORT/v1" "$model" "$1" \
    "$PREFIXES" "$2" | tee -a "$OUT/results.jsonl"
}

start_cluster serve1
phase cold 1
phase ram 2
stop_cluster
du -sh "$STORE" | sed 's/^/[bench] store after shutdown: /'
# A restart on a machine that rebooted finds no store page in the page cache:
# drop this store's pages (posix_fadvise DONTNEED; nothing else is touched).
"$VENV/bin/python" - "$STORE" <<'EOF'
import os, sys
n = 0
for root, _, files in os.walk(sys.argv[1]):
    for f in files:
        fd = os.open(os.path.join(root, f), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
print(f"[bench] dropped the page cache of {n} store files")
EOF
start_cluster serve2
if [ "$WARMUP" = 1 ]; then
  # One short request of another prompt first: the restart phase then measures
  # the restore, not the first request's process warm-up (page faults of the
  # pools, the first prefill -> decode data connection).
  model=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | python3 -c \
    'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"Warm up.\", \"max_tokens\": 2}" >/dev/null
  echo "[bench] one warm-up request served after the restart"
fi
phase restart 3
stop_cluster

"$VENV/bin/python" - "$OUT/results.jsonl" <<'EOF'
import json, statistics, sys, platform, subprocess
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["phase"], []).append(r)
med = {p: statistics.median(r["ttft_s"] for r in rs) for p, rs in by.items()}
cpu = subprocess.run("lscpu | sed -n 's/^Model name: *//p'", shell=True, capture_output=True,
                     text=True).stdout.strip()
print(f"\n| phase | prefixes | median TTFT (s) | prompt tokens | cached tokens (min) |")
print("|---|---|---|---|---|")
for p in ("cold", "ram", "restart"):
    rs = by.get(p, [])
    if not rs:
        continue
    print(f"| {p} | {len(rs)} | {med[p]:.3f} | {rs[0]['prompt_tokens']} | "
          f"{min(r['cached_tokens'] for r in rs)} |")
if "cold" in med and "restart" in med:
    frac = min(r["cached_tokens"] / r["prompt_tokens"] for r in by["restart"])
    print(f"\nspeedup cold -> after restart: {med['cold'] / med['restart']:.1f}x, "
          f"cached after restart >= {100 * frac:.1f}% of the prompt (target: >= 20x, >= 95%)")
    print(f"(ram hit: {med['cold'] / med['ram']:.1f}x; CPU: {cpu})")
EOF
