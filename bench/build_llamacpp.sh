#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server)
# from the llama.cpp inside the pinned llama-cpp-python sdist (PyPI), the way
# its users build it for a CPU, for the side-by-side benchmarks (not a test):
#
#   bench/build_llamacpp.sh [native|avx2]     prints the bin directory on stdout
#
#   native  GGML_NATIVE=ON (-march=native) with AMX switched off (-mno-amx-*):
#           some VMs list AMX but fault on its first tile instruction, so a
#           native build would crash there; elsewhere this is plain -march=native.
#           -> ~/.cache/kvrelay-bench/llama-build
#   avx2    GGML_NATIVE=OFF with SSE4.2/AVX/AVX2/FMA/F16C/BMI2 and no AVX-512:
#           what an AVX2-only machine's native build enables, to compare against
#           kvrelay's AVX2 kernels (KVRELAY_KERNELS=avx2) on an AVX-512 machine.
#           -> ~/.cache/kvrelay-bench/llama-build-avx2
#
# Idempotent: a build whose CMakeCache.txt holds this llama.cpp source and these
# options, with the tools built, is reused; anything else is reconfigured and
# rebuilt. Build output goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

flavor=${1:-native}
CACHE=${CACHE:-$HOME/.cache/kvrelay-bench}
LLAMA_CPP_PYTHON_VERSION=0.3.36  # as tools/reference/setup_venv.sh pins
common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
  -DBUILD_SHARED_LIBS=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
case $flavor in
  native)
    dir=$CACHE/llama-build
    config=(-DGGML_NATIVE=ON)
    # Only a CPU that lists AMX gets it from -march=native; an explicit -mno-*
    # wins over -march whatever the order. Elsewhere the flags would change
    # nothing, so they are left out (and an existing native build stays valid).
    if grep -qw amx_tile /proc/cpuinfo; then
      no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
      config+=("-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
    fi ;;
  avx2)
    dir=$CACHE/llama-build-avx2
    config=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
      -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
      -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF) ;;
  *) echo "usage: $0 [native|avx2]" >&2; exit 2 ;;
esac
targets=(llama-bench llama-batched-bench llama-server)
# ready: the build in $dir was configured from this llama.cpp with these -D
# options (each NAME=VALUE is in its CMakeCache.txt) and every tool is built.
ready() {
  local cache=$dir/CMakeCache.txt opt name value
  [[ -f $cache ]] || return 1
  grep -q "^CMAKE_HOME_DIRECTORY:INTERNAL=.*/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp$" \
    "$cache" || return 1
  for opt in "${common[@]}" "${config[@]}"; do
    [[ $opt == -D* ]] || continue
    name=${opt#-D}; value=${name#*=}; name=${name%%=*}
    [[ $name == CMAKE_*_COMPILER_LAUNCHER ]] && continue
    grep -qxE "$name:[A-Z]+=$(printf '%s' "$value" | sed 's/[][\.*^$+?(){}|/]/\\&/g')" "$cache" || return 1
  done
  for t in "${targets[@]}"; do [[ -x $dir/bin/$t ]] || return 1; done
}
if ready; then
  echo "$dir/bin"
  exit 0
fi

src=$CACHE/src
sdist=$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
mkdir -p "$src"
if [[ ! -d $sdist/vendor/llama.cpp ]]; then
  echo "[build_llamacpp] fetching llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (sdist) from PyPI" >&2
  python3 -m pip download -q --no-deps --no-binary :all: -d "$src" \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
  tar xzf "$sdist.tar.gz" -C "$src"
fi
launcher=()
command -v ccache >/dev/null &&
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
echo "[build_llamacpp] building $flavor llama.cpp tools in $dir (several minutes on 2 cores)" >&2
# A cache made from another source tree cannot be reconfigured in place.
if [[ -f $dir/CMakeCache.txt ]] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$sdist/vendor/llama.cpp" \
  "$dir/CMakeCache.txt"; then
  rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
fi
cmake -S "$sdist/vendor/llama.cpp" -B "$dir" "${common[@]}" "${config[@]}" "${launcher[@]}" >&2
nice cmake --build "$dir" --target "${targets[@]}" -j "$(nproc)" >&2
ready || { echo "[build_llamacpp] $dir is not configured as asked after the build" >&2; exit 1; }
echo "$dir/bin"
