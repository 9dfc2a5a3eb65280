#!/usr/bin/env bash
# KV cache dtype quality table (docs/BENCHMARKS.md, section "KV cache dtypes"):
# for f32, f16, bf16, int8, kivi4, kivi2 — bytes/token, perplexity on a text
# vs f32, teacher-forced greedy top-1 agreement with f32, and the CPU cost of
# WriteToken/ReadHead. Runs `kvrelay bench kv` (cli/bench_kv_cmd.cc).
#
# usage: bench/kv_quality.sh [BUILD_DIR] [TEXT_FILE]
#   BUILD_DIR  a build with the kvrelay CLI (default: build)
#   TEXT_FILE  default: the first tests/data/*.txt
# env: MODEL (default models/SmolLM2-135M-Instruct.Q4_1.gguf), CTX (512),
#      CHUNKS (4), GEN (512), PROMPT_TOKENS (64), THREADS (nproc), DTYPES.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
TEXT=${2:-$(ls tests/data/*.txt 2>/dev/null | head -n 1 || true)}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
KVRELAY="$BUILD_DIR/cli/kvrelay"
if [ ! -x "$KVRELAY" ]; then
  echo "kv_quality: $KVRELAY not found; build it first (scripts/build.sh $BUILD_DIR)" >&2
  exit 1
fi
if [ -z "$TEXT" ] || [ ! -f "$TEXT" ]; then
  echo "kv_quality: no text file (pass one, or add tests/data/*.txt)" >&2
  exit 1
fi
args=(bench kv --model "$MODEL" --file "$TEXT" --ctx "${CTX:-512}" --chunks "${CHUNKS:-4}"
      --gen "${GEN:-512}" --prompt-tokens "${PROMPT_TOKENS:-64}" --threads "${THREADS:-$(nproc)}")
[ -n "${DTYPES:-}" ] && args+=(--dtypes "$DTYPES")
echo "command: kvrelay ${args[*]}"
echo "date:    $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "cpu:     $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) cores)"
echo "commit:  $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo
"$KVRELAY" "${args[@]}"
