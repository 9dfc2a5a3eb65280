#!/usr/bin/env bash
# Runs kvrelay and llama.cpp (llama-cpp-python) on the same GGUF with the same
# thread count, alternating the two programs run by run, and prints the
# medians and the ratios kvrelay / llama.cpp for pp<P> and tg<G>.
#
#   bench/compare_llamacpp.sh [--model M | --gemma] [--threads T] [--reps N] [--pp 512] [--tg 128]
#                             [--llama-build native|avx2] [--kvrelay path/to/kvrelay]
#                             [--llama-bench path/to/llama-bench] [--python-llama] [--out DIR]
# --out DIR also writes what it prints to DIR/compare.txt, for
#   bench/report.py record engine DIR   (docs/BENCHMARKS.md's engine table).
# --gemma = --model models/gemma-3-270m-q4_k_m.gguf (scripts/fetch-model.sh gemma3-270m).
#
# llama.cpp: its own llama-bench (one untimed warm-up, then one timed run per
# call, -r 1), built by bench/build_llamacpp.sh from the llama.cpp inside the
# pinned llama-cpp-python sdist when it is not built yet:
#   --llama-build native (default): -march=native with AMX off, kvrelay with the
#                 kernels it picks at run time;
#   --llama-build avx2: llama.cpp built for an AVX2-only CPU and kvrelay forced
#                 to its AVX2 kernels (KVRELAY_KERNELS=avx2): the AVX2-only
#                 machine's comparison, emulated on an AVX-512 one.
# --llama-bench PATH uses that binary instead; --python-llama uses
# llama-cpp-python from a private venv (/opt/llamacpp-venv if it exists, else
# .venv-llamacpp, created with `pip install llama-cpp-python` on first use).
set -euo pipefail
cd "$(dirname "$0")/.."

model=models/SmolLM2-135M-Instruct.Q4_1.gguf
threads=$(nproc)
reps=5
pp=512
tg=128
kvrelay=""
llama_bench=""
llama_build=native
python_llama=0
out_dir=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --gemma) model=models/gemma-3-270m-q4_k_m.gguf; shift ;;
    --threads) threads=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --pp) pp=$2; shift 2 ;;
    --tg) tg=$2; shift 2 ;;
    --kvrelay) kvrelay=$2; shift 2 ;;
    --llama-bench) llama_bench=$2; shift 2 ;;
    --llama-build) llama_build=$2; shift 2 ;;
    --python-llama) python_llama=1; shift ;;
    --out) out_dir=$2; shift 2 ;;
    *) echo "compare_llamacpp.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
if [[ -z "$kvrelay" ]]; then
  for c in build/cli/kvrelay build-*/cli/kvrelay; do
    if [[ -x $c ]]; then kvrelay=$c; break; fi
  done
fi
[[ -x "$kvrelay" ]] || { echo "compare_llamacpp.sh: no kvrelay binary (build it or pass --kvrelay)" >&2; exit 1; }
[[ -f "$model" ]] || { echo "compare_llamacpp.sh: model not found: $model" >&2; exit 1; }

case $llama_build in
  native) ;;
  avx2) export KVRELAY_KERNELS=avx2 ;;
  *) echo "compare_llamacpp.sh: --llama-build native|avx2" >&2; exit 2 ;;
esac
if [[ -z "$llama_bench" && $python_llama == 0 ]]; then
  llama_bench=$(bench/build_llamacpp.sh "$llama_build")/llama-bench
fi

py=""
if [[ -n "$llama_bench" ]]; then
  [[ -x "$llama_bench" ]] || { echo "compare_llamacpp.sh: not executable: $llama_bench" >&2; exit 1; }
elif [[ -x /opt/llamacpp-venv/bin/python ]]; then
  py=/opt/llamacpp-venv/bin/python
else
  if [[ ! -x .venv-llamacpp/bin/python ]]; then
    python3 -m venv .venv-llamacpp
    .venv-llamacpp/bin/pip install --quiet llama-cpp-python
  fi
  py=.venv-llamacpp/bin/python
fi

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
# Prints a line, and keeps it in $out_dir/compare.txt with --out.
if [[ -n "$out_dir" ]]; then mkdir -p "$out_dir" && : >"$out_dir/compare.txt"; fi
say() {
  echo "$*"
  if [[ -n "$out_dir" ]]; then echo "$*" >>"$out_dir/compare.txt"; fi
}

kv_pp=(); kv_tg=(); ll_pp=(); ll_tg=()
say "model $model, threads $threads, $reps alternating runs each (pp$pp, tg$tg)," \
  "llama.cpp build $llama_build${KVRELAY_KERNELS:+, kvrelay kernels $KVRELAY_KERNELS}"
for ((i = 1; i <= reps; i++)); do
  out=$("$kvrelay" bench engine --model "$model" --threads "$threads" --reps 1 --pp "$pp" \
        --tg "$tg" --skip-batches)
  kernels=$(sed -n 's/.*, kernels \([^,]*\),.*/\1/p' <<<"$out" | head -1)
  kv_pp+=("$(awk -v k="pp$pp" '$1==k {print $2}' <<<"$out")")
  kv_tg+=("$(awk -v k="tg$tg" '$1==k {print $2}' <<<"$out")")
  if [[ -n "$llama_bench" ]]; then
    # pp and tg as separate tests (-p P -n 0, -p 0 -n G), as kvrelay's bench.
    out=$("$llama_bench" -m "$model" -t "$threads" -p "$pp" -n "$tg" -r 1 -o json 2>/dev/null |
          python3 -c 'import json, sys
d = json.load(sys.stdin)
pp = [x["avg_ts"] for x in d if x["n_gen"] == 0][0]
tg = [x["avg_ts"] for x in d if x["n_prompt"] == 0][0]
print("pp %.2f tg %.2f llama-bench %s" % (pp, tg, d[0].get("build_commit", "?")))')
  else
    out=$("$py" bench/llamacpp_bench.py --model "$model" --threads "$threads" --pp "$pp" --tg "$tg" \
          --seed "$i")
  fi
  ll_pp+=("$(awk '{print $2}' <<<"$out")")
  ll_tg+=("$(awk '{print $4}' <<<"$out")")
  llver=$(awk '{print $5, $6}' <<<"$out")
  say "run $i: kvrelay pp ${kv_pp[-1]} tg ${kv_tg[-1]} | llama.cpp pp ${ll_pp[-1]} tg ${ll_tg[-1]}"
done
kpp=$(printf '%s\n' "${kv_pp[@]}" | median); ktg=$(printf '%s\n' "${kv_tg[@]}" | median)
lpp=$(printf '%s\n' "${ll_pp[@]}" | median); ltg=$(printf '%s\n' "${ll_tg[@]}" | median)
say "kvrelay kernels $kernels, llama.cpp $llver"
say "median tok/s       kvrelay   llama.cpp ($llver)   ratio kvrelay/llama.cpp"
say "$(awk -v a="$kpp" -v b="$lpp" -v n="pp$pp" 'BEGIN {printf "%-16s %9.2f %11.2f %38.3f", n, a, b, a / b}')"
say "$(awk -v a="$ktg" -v b="$ltg" -v n="tg$tg" 'BEGIN {printf "%-16s %9.2f %11.2f %38.3f", n, a, b, a / b}')"
