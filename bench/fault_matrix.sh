#!/usr/bin/env bash
# The fault matrix's figures for docs/BENCHMARKS.md: runs fault_matrix_test
# (the short form, one round per fault) N times in the build tree, keeping its
# output, then `bench/report.py record faults OUT` adds the runs to
# bench/results/faults.json and `bench/report.py render` rewrites the table.
#
#   bench/fault_matrix.sh [-n runs] [-m migration-limit] [-b build-dir] -O OUT
#
# -m passes KVRELAY_FAULTS_MIGRATION_LIMIT (0: the behaviour before issue #39,
# a fault's requests fail instead of moving). Each run is ~2.5 min on 2 cores;
# run it on a quiet machine: the matrix's bounds follow the capacity it
# measures just before each fault.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3 limit="" build=build out=""
while getopts "n:m:b:O:" opt; do
  case $opt in
    n) runs=$OPTARG ;; m) limit=$OPTARG ;; b) build=$OPTARG ;; O) out=$OPTARG ;;
    *) sed -n '2,12p' "$0" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "fault_matrix.sh: -O OUT is required" >&2; exit 2; }
mkdir -p "$out"
printf '{"runs": %d, "migration_limit": %s}\n' "$runs" "${limit:-null}" > "$out/meta.json"
env ${limit:+KVRELAY_FAULTS_MIGRATION_LIMIT=$limit} \
  ctest --test-dir "$build" -R '^fault_matrix_test$' --repeat "until-fail:$runs" -V > "$out/fm.log" 2>&1 || {
  echo "fault_matrix.sh: the matrix failed; its output: $out/fm.log" >&2
  exit 1
}
echo "fault_matrix.sh: $(grep -c 'FAULT ' "$out/fm.log") fault lines in $out/fm.log"
