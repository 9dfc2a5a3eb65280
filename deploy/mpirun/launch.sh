#!/usr/bin/env bash
# One MPMD mpirun that starts the whole cluster: rank 0 is the coordinator,
# then P prefill ranks and D decode groups of T ranks each (D*T processes).
# Workers take their data-plane peer index from OMPI_COMM_WORLD_RANK /
# OMPI_COMM_WORLD_SIZE; a decode rank's TP rank is its offset within its group
# (consecutive world ranks), and TP rank 0 of group g listens for the group on
# 127.0.0.1:(control-port + 1 + g). The ranks of one TP group must therefore
# share a host (mpirun's default --map-by slot keeps consecutive ranks
# together; TP belongs inside a node).
#
#   deploy/mpirun/launch.sh [-P prefill] [-D decode] [-T tp] [-H hostfile] [-c coordinator-host]
#                           [-m model] [-p http-port] [-C control-port] [-b bin-dir]
#                           [-k kv-dtype] [-t threads-per-worker] [-K cluster-key-file]
# Every process proves the cluster key (-K) on the internal ports; without -K a
# fresh key is generated for this run in a private temporary directory (one
# machine only: with -H, pass -K FILE present at that path on every host).
# Every process gets the same --kv-dtype (the coordinator's handshake rejects
# workers whose KV layout differs).
# Example (one machine, 2 cores): deploy/mpirun/launch.sh -P 1 -D 1
# Example (hosts):               deploy/mpirun/launch.sh -H deploy/mpirun/hostfile.example -c node0 -P 2 -D 2
set -euo pipefail
cd "$(dirname "$0")/../.."

P=1 D=1 T=1 HOSTFILE="" COORD=127.0.0.1
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf PORT=8080 CONTROL=9000 BIN=build/bin KV=f32 THREADS=0 KEY=""
while getopts "P:D:T:H:c:m:p:b:C:k:t:K:" opt; do
  case $opt in
    P) P=$OPTARG ;; D) D=$OPTARG ;; T) T=$OPTARG ;; H) HOSTFILE=$OPTARG ;;
    c) COORD=$OPTARG ;; m) MODEL=$OPTARG ;; p) PORT=$OPTARG ;; b) BIN=$OPTARG ;;
    C) CONTROL=$OPTARG ;; k) KV=$OPTARG ;; t) THREADS=$OPTARG ;; K) KEY=$OPTARG ;;
    *) echo "usage: $0 [-P n] [-D n] [-T tp] [-H hostfile] [-c coordinator-host] [-m model] [-p port]" \
            "[-C control-port] [-b bin-dir] [-k kv-dtype] [-t threads] [-K key-file]" >&2; exit 2 ;;
  esac
done
if ! [ "$T" -ge 1 ] 2>/dev/null; then
  echo "launch.sh: -T must be a positive integer, got '$T'" >&2
  exit 2
fi

if [ -z "$KEY" ]; then
  if [ -n "$HOSTFILE" ]; then
    echo "launch.sh: with -H, pass -K FILE (the cluster key, present at that path on every host)" >&2
    exit 2
  fi
  KEYDIR=$(mktemp -d "${TMPDIR:-/tmp}/kvrelay-mpirun-XXXXXX")
  trap 'rm -rf "$KEYDIR"' EXIT
  trap 'exit 143' TERM INT  # run the EXIT trap on a stop too
  KEY="$KEYDIR/cluster.key"
  (umask 077; od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$KEY"; echo >> "$KEY")
fi

# --bind-to none: a worker runs an engine thread pool and transport threads; the
# default one-core-per-rank binding would put them all on one core.
args=(--allow-run-as-root --oversubscribe --bind-to none)
[ -n "$HOSTFILE" ] && args+=(--hostfile "$HOSTFILE")
# Workers listen for KV on all interfaces when spread over hosts.
KVHOST=127.0.0.1
[ -n "$HOSTFILE" ] && KVHOST=0.0.0.0

# Exported for the decode ranks' wrapper above.
export TP="$T" TPBASE=$((CONTROL + 1))
args+=(-x TP -x TPBASE)

# Not exec: the EXIT trap removes a generated key once mpirun is done.
mpirun "${args[@]}" \
  -np 1 "$BIN/kvrelay-coordinator" --model "$MODEL" --host "$COORD" --port "$PORT" --control-port "$CONTROL" \
    --control-host "$COORD" --cluster-key-file "$KEY" --kv-dtype "$KV" : \
  -np "$P" "$BIN/kvrelay-prefill" --coordinator "$COORD:$CONTROL" --model "$MODEL" --kv-host "$KVHOST" \
    --kv-dtype "$KV" --threads "$THREADS" --cluster-key-file "$KEY" : \
  -np "$((D * T))" /bin/bash -c '
    i=$((OMPI_COMM_WORLD_RANK - 1 - $1)); g=$((i / $2)); r=$((i % $2)); shift 2
    id="decode-$g"; [ "$r" -gt 0 ] && id="$id-tp$r"
    tp=(); [ "$TP" -gt 1 ] && tp=(--tp-size "$TP" --tp-rank "$r" --tp-leader "127.0.0.1:$((TPBASE + g))")
    exec "$@" --id "$id" "${tp[@]}"' decode "$P" "$T" \
    "$BIN/kvrelay-decode" --coordinator "$COORD:$CONTROL" --model "$MODEL" --kv-host "$KVHOST" \
    --kv-dtype "$KV" --threads "$THREADS" --cluster-key-file "$KEY"
