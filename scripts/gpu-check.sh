#!/usr/bin/env bash
# The GPU check of issue #16: CUDA backend vs CPU engine, decode/prefill
# throughput against the HBM roofline, cuda_ipc between two processes and a
# 1-rank NCCL communicator, on one GPU, in under 8 minutes.
#
#   scripts/gpu-check.sh --prepare   (here, on the dev machine) copy the static
#        OpenSSL/xxHash archives and headers the minimal build needs into
#        build-gpu-deps/ (carry that folder to the GPU machine) and check that
#        the minimal configuration configures and compiles (build-gpu/)
#   scripts/gpu-check.sh --dry-run   (here, after --prepare) the tool starts,
#        refuses without a GPU (exit 3), generates a synthetic model; CI runs it
#   scripts/gpu-check.sh             (on the GPU machine) build the minimal
#        configuration, generate the synthetic models, run every check
#
# The GPU machine has CUDA 13, CMake, ninja and 16 cores but no Debian dev
# packages and no network, so the build is KVRELAY_MINIMAL_GPU=ON: engine core
# + CUDA + tests/gpu/kvrelay_gpu_check, OpenSSL/xxHash from build-gpu-deps/,
# no ICU (a tokenizer stub), no MPI/protobuf/Boost/RocksDB/GoogleTest.
# Models are generated there (the real 98 MB model does not travel): the
# default model's shape (SmolLM2-135M, Q4_1, vocab 49152), Llama-2-7B's
# (Q4_0) and Gemma 3 270M's (Q8_0, windows, QK norms, GeGLU, soft-capping),
# random weights from the project's GGUF writer and quantizers.
#
# Without a GPU it prints "no GPU", measures and records nothing, exits 0.
# Environment: GPU_CHECK_OUT (log + results dir, default $OUT or /tmp/kvrelay-gpu-check),
# GPU_CHECK_7B_LAYERS (default 32), GPU_CHECK_HBM_TBPS (default 4.8, H200),
# GPU_CHECK_JOBS (default nproc).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${GPU_CHECK_BUILD:-build-gpu}
DEPS=$ROOT/build-gpu-deps
JOBS=${GPU_CHECK_JOBS:-$(nproc)}
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
say() { echo "[gpu-check +$(elapsed)s] $*"; }

export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

configure_and_build() {
  # -Werror only here (--prepare): the GPU machine's host compiler may warn
  # about things this one does not, and that must not stop the check.
  local args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DKVRELAY_MINIMAL_GPU=ON -DKVRELAY_WITH_CUDA=ON
              -DCMAKE_CUDA_ARCHITECTURES=90 -DKVRELAY_WERROR=${WERROR:-OFF})
  [ -d "$DEPS/lib" ] && args+=(-DKVRELAY_DEPS_PREFIX="$DEPS")
  command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  mkdir -p "$BUILD"
  if [ ! -f "$BUILD/build.ninja" ]; then
    say "configuring $BUILD (KVRELAY_MINIMAL_GPU=ON)"
    cmake -S . -B "$BUILD" "${args[@]}" > "$BUILD/gpu-check-configure.log" 2>&1 || {
      cat "$BUILD/gpu-check-configure.log"; return 1; }
    grep -E "kvrelay: CUDA" "$BUILD/gpu-check-configure.log"
  fi
  say "building kvrelay_gpu_check (-j $JOBS)"
  cmake --build "$BUILD" --target kvrelay_gpu_check -j "$JOBS" > "$BUILD/gpu-check-build.log" 2>&1 || {
    tail -40 "$BUILD/gpu-check-build.log"; return 1; }
}

if [ "${1:-}" = "--prepare" ]; then
  WERROR=ON
  # Static archives + headers of the two libraries kvrelay_common needs.
  mkdir -p "$DEPS/lib" "$DEPS/include"
  for lib in libcrypto.a libxxhash.a; do
    f=$(ls /usr/lib/x86_64-linux-gnu/$lib 2>/dev/null | head -1)
    [ -n "$f" ] || { echo "gpu-check --prepare: $lib not found (apt-get install libssl-dev libxxhash-dev)"; exit 1; }
    cp "$f" "$DEPS/lib/"
  done
  rm -rf "$DEPS/include/openssl"
  cp -r /usr/include/openssl "$DEPS/include/"
  cp /usr/include/x86_64-linux-gnu/openssl/*.h "$DEPS/include/openssl/" 2>/dev/null || true
  cp /usr/include/xxhash.h "$DEPS/include/"
  # nlohmann-json (header-only, the engine's grammar): headers + its CMake package.
  rm -rf "$DEPS/include/nlohmann" "$DEPS/share/cmake/nlohmann_json"
  [ -d /usr/include/nlohmann ] || { echo "gpu-check --prepare: nlohmann-json not found (apt-get install nlohmann-json3-dev)"; exit 1; }
  cp -r /usr/include/nlohmann "$DEPS/include/"
  mkdir -p "$DEPS/share/cmake"
  cp -r /usr/share/cmake/nlohmann_json "$DEPS/share/cmake/"
  du -sh "$DEPS"
  configure_and_build || { say "FAIL: the minimal configuration does not build"; exit 1; }
  ls -la "$BUILD/tests/gpu/kvrelay_gpu_check"
  say "prepared: carry build-gpu-deps/ to the GPU machine (run with carry=[\"build-gpu-deps\"])"
  exit 0
fi

if [ "${1:-}" = "--dry-run" ]; then
  # Here, without a GPU, after --prepare: what of the run can be checked on
  # the CPU is checked (the tool starts, finds no device and says so with exit
  # 3; the default shape's synthetic model is generated), and the GPU steps
  # are listed. Measures and records nothing.
  BIN=$BUILD/tests/gpu/kvrelay_gpu_check
  [ -x "$BIN" ] || { say "FAIL: $BIN is not built (run scripts/gpu-check.sh --prepare first)"; exit 1; }
  "$BIN" probe
  rc=$?
  if [ $rc -eq 0 ]; then say "a GPU is present: run scripts/gpu-check.sh without --dry-run"; exit 0; fi
  [ $rc -eq 3 ] || { say "FAIL: probe exited $rc (expected 3, no GPU)"; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$BIN" gen --shape default --layers 2 --out "$tmp/default.gguf" || { say "FAIL: gen"; exit 1; }
  [ -s "$tmp/default.gguf" ] || { say "FAIL: gen wrote no model"; exit 1; }
  say "dry run ok: the tool runs, refuses without a GPU, generates models; on a GPU it runs:"
  say "  gen default/7B/gemma3, agree default/7B/gemma3, bench default/7B, sample, ipc, nccl1"
  exit 0
fi

# No GPU: claim nothing.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no GPU on this machine (nvidia-smi finds no device): nothing measured, nothing recorded"
  exit 0
fi

OUTDIR=${GPU_CHECK_OUT:-${OUT:-/tmp/kvrelay-gpu-check}}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu-check.log
exec > >(tee "$LOG") 2>&1
say "$(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv,noheader
lscpu | grep -m1 "Model name" || true

configure_and_build || { say "FAIL: build"; exit 1; }
BIN=$BUILD/tests/gpu/kvrelay_gpu_check
"$BIN" probe
rc=$?
if [ $rc -eq 3 ]; then
  echo "gpu-check: no GPU usable by CUDA: nothing measured, nothing recorded"
  exit 0
fi

MODELS=${TMPDIR:-/tmp}/kvrelay-gpu-models
mkdir -p "$MODELS"
FAILS=0
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  say "== $name"
  timeout "$limit" "$@"
  local r=$?
  if [ $r -ne 0 ]; then
    FAILS=$((FAILS + 1))
    say "FAIL $name (exit $r)"
  fi
}

step "generate default-model shape" 120 "$BIN" gen --shape default --out "$MODELS/default.gguf"
step "generate 7B shape" 180 "$BIN" gen --shape 7b --layers "${GPU_CHECK_7B_LAYERS:-32}" --out "$MODELS/7b.gguf"
step "agree: default shape" 120 "$BIN" agree --model "$MODELS/default.gguf" --prompt 32 --steps 64
step "agree: 7B shape" 180 "$BIN" agree --model "$MODELS/7b.gguf" --prompt 32 --steps 64
step "generate Gemma 3 shape" 120 "$BIN" gen --shape gemma3 --out "$MODELS/gemma3.gguf"
step "agree: Gemma 3 shape" 120 "$BIN" agree --model "$MODELS/gemma3.gguf" --prompt 32 --steps 64
HBM=${GPU_CHECK_HBM_TBPS:-4.8}
step "bench: default shape" 90 "$BIN" bench --model "$MODELS/default.gguf" --batches 1,16,64,256 --prefill 512 --hbm-tbps "$HBM"
step "bench: 7B shape" 180 "$BIN" bench --model "$MODELS/7b.gguf" --batches 1,16,64,256 --prefill 512 --hbm-tbps "$HBM"
step "device sampling" 30 "$BIN" sample
step "cuda_ipc between two processes" 60 "$BIN" ipc --mib 64
step "1-rank NCCL communicator" 60 "$BIN" nccl1
rm -f "$MODELS/default.gguf" "$MODELS/7b.gguf" "$MODELS/gemma3.gguf"
say "done: $FAILS failed step(s); log in $LOG"
[ $FAILS -eq 0 ]
