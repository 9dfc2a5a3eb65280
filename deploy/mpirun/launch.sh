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
#                           [-k kv-dtype] [-t threads-per-worker] [-B heartbeat-ms]
#                           [-K cluster-key-file] [-X kv-transport] [-W kv-timeout-ms]
#                           [-M tp-comm] [-R max-restarts] [-S tls-dir]
#                           [--heartbeat-timeout-ms N] [--tp-step-timeout-ms N]
#                           [--kv-progress-timeout-ms N] [--coordinator-timeout-ms N]
#                           [--max-running N] [--max-queue-delay-ms N]
#                           [--prefill-device cpu|cuda[:N]] [--decode-device cpu|cuda[:N]]
# Every process gets the same --kv-dtype (the coordinator's handshake rejects
# workers whose KV layout differs).
#
# Across hosts (-H): rank 0 (the coordinator) lands on the hostfile's first
# host and -c must name that host as the workers can resolve it. The
# coordinator listens on the address -c resolves to on its own host; each
# worker listens on and advertises the address of its interface that routes
# to the coordinator (--kv-host, --advertise-host), never a wildcard, so peers
# on other hosts can dial its KV port. Placement follows the hostfile's slots in order
# (coordinator, prefill ranks, then the decode ranks group by group), so a
# hostfile "c slots=1 / p0 slots=1 / d0 slots=T" puts prefill and decode on
# different hosts and each TP group inside one. How mpirun reaches the hosts
# is Open MPI's business: ssh by default, or any agent given as
# OMPI_MCA_plm_rsh_agent (tests/multinode uses one that enters a network
# namespace).
#
# Cluster key: when the binaries take --cluster-key-file (the coordinator is
# asked), every process gets -K FILE, or a fresh key written (mode 0600) for
# this launch and removed when it ends; across hosts -K must name a file that
# exists on every host.
#
# -S DIR runs the control plane over mutual TLS 1.3 with the certificates
# scripts/make-cluster-certs.sh wrote to DIR (the coordinator gets
# coordinator.crt/.key, every worker worker.crt/.key, all ca.crt); across hosts
# DIR must exist at the same path on every host. The cluster key is still
# proved inside TLS.
#
# --prefill-device / --decode-device D pass --device D to those workers, as
# kvrelay launch does: a TP group given plain "cuda" puts rank r on cuda:r (one
# GPU per rank; the group shares a host); "cuda:N" puts every rank on N.
#
# -X passes --kv-transport to the workers (tcp | mpi | auto; without -X the
# binaries choose: auto = MPI when started by mpirun and MPI is initialised).
# -M passes --tp-comm to the workers (tcp | mpi | auto: a decode group's
# collectives on its TCP link or its MPI sub-communicator; auto = MPI when the
# KV data plane is MPI).
# -W passes --kv-timeout-ms (how long a decode worker waits for a request's KV
# after its first token; the wait before it is capped at 10x; default 30 s).
#
# The silent-fault deadlines take the binaries' own long flags, as `kvrelay
# launch` does: --heartbeat-timeout-ms goes to the coordinator (drop a worker
# silent this long), --tp-step-timeout-ms, --kv-progress-timeout-ms and
# --coordinator-timeout-ms to every worker (and to a restarted one: the
# supervisor reuses the flags). Unset, each binary's default applies.
# --max-running and --max-queue-delay-ms (admission) go to the coordinator.
#
# The job runs with --enable-recovery: a rank that dies (a worker killed, a
# host lost) does not end the others; the coordinator learns of it from the
# control plane (closed connection, missed heartbeats) and routes around it.
#
# -R N (needs -X tcp) supervises every process: each rank runs its binary
# under a small bash supervisor, and a binary that exits non-zero (kill -9, a
# crash) is started again on the same host with the same flags after a backoff
# (250 ms, doubled per earlier restart inside the window, at most 8 s), at
# most N times within 60 s (-w seconds), each restart logged. The restarted
# process runs outside MPI (its OMPI_*/PMIX_* environment removed, its rank
# and world size passed as flags): an Open MPI 4.1 job cannot take a new
# process into MPI_COMM_WORLD, so the KV data plane must be TCP (-X tcp; a
# TP group's collectives then run on its TCP link). It registers again and the
# cluster routes to it; a TP group re-forms as its ranks come back. A clean
# exit (status 0, e.g. SIGTERM at the end of the job) is not restarted.
#
# Example (one machine, 2 cores): deploy/mpirun/launch.sh -P 1 -D 1
# Example (hosts):               deploy/mpirun/launch.sh -H deploy/mpirun/hostfile.example -c node0 -P 2 -D 2
set -euo pipefail
cd "$(dirname "$0")/../.."

P=1 D=1 T=1 HOSTFILE="" COORD=127.0.0.1 HEARTBEAT=500 KEYFILE="" TRANSPORT="" KVTIMEOUT="" TPCOMM=""
RESTARTS="" WINDOW=60 TLSDIR="" PDEV=cpu DDEV=cpu
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf PORT=8080 CONTROL=9000 BIN=build/bin KV=f32 THREADS=0
# The long options (deadlines) come out first; getopts reads the rest.
copts=() wdeadlines=() rest=()
while [ $# -gt 0 ]; do
  case $1 in
    --heartbeat-timeout-ms | --tp-step-timeout-ms | --kv-progress-timeout-ms | --coordinator-timeout-ms | \
      --max-running | --max-queue-delay-ms)
      if [ $# -lt 2 ] || ! [ "$2" -ge 0 ] 2>/dev/null; then
        echo "launch.sh: $1 needs a number, got '${2-}'" >&2
        exit 2
      fi
      case $1 in
        --heartbeat-timeout-ms | --max-running | --max-queue-delay-ms) copts+=("$1" "$2") ;;
        *) wdeadlines+=("$1" "$2") ;;
      esac
      shift 2 ;;
    --prefill-device | --decode-device)
      case ${2-} in
        cpu | cuda | cuda:[0-9] | cuda:[0-9][0-9]) ;;
        *) echo "launch.sh: $1 must be cpu, cuda or cuda:N, got '${2-}'" >&2; exit 2 ;;
      esac
      if [ "$1" = --prefill-device ]; then PDEV=$2; else DDEV=$2; fi
      shift 2 ;;
    *) rest+=("$1"); shift ;;
  esac
done
set -- "${rest[@]}"
while getopts "P:D:T:H:c:m:p:b:C:k:t:B:K:X:W:M:R:w:S:" opt; do
  case $opt in
    P) P=$OPTARG ;; D) D=$OPTARG ;; T) T=$OPTARG ;; H) HOSTFILE=$OPTARG ;;
    c) COORD=$OPTARG ;; m) MODEL=$OPTARG ;; p) PORT=$OPTARG ;; b) BIN=$OPTARG ;;
    C) CONTROL=$OPTARG ;; k) KV=$OPTARG ;; t) THREADS=$OPTARG ;; B) HEARTBEAT=$OPTARG ;;
    K) KEYFILE=$OPTARG ;; X) TRANSPORT=$OPTARG ;; W) KVTIMEOUT=$OPTARG ;; M) TPCOMM=$OPTARG ;;
    R) RESTARTS=$OPTARG ;; w) WINDOW=$OPTARG ;; S) TLSDIR=$OPTARG ;;
    *) echo "usage: $0 [-P n] [-D n] [-T tp] [-H hostfile] [-c coordinator-host] [-m model] [-p port]" \
            "[-C control-port] [-b bin-dir] [-k kv-dtype] [-t threads] [-B heartbeat-ms] [-K key-file]" \
            "[-X tcp|mpi|auto] [-W kv-timeout-ms] [-M tcp|mpi|auto] [-R max-restarts [-w window-s]]" \
            "[-S tls-dir] [--heartbeat-timeout-ms N] [--tp-step-timeout-ms N]" \
            "[--kv-progress-timeout-ms N] [--coordinator-timeout-ms N] [--max-running N]" \
            "[--max-queue-delay-ms N]" >&2
       exit 2 ;;
  esac
done
for v in P D T; do
  if ! [ "${!v}" -ge 1 ] 2>/dev/null; then
    echo "launch.sh: -$v must be a positive integer, got '${!v}'" >&2
    exit 2
  fi
done
if [ -n "$RESTARTS" ]; then
  if ! [ "$RESTARTS" -ge 0 ] 2>/dev/null || ! [ "$WINDOW" -ge 1 ] 2>/dev/null; then
    echo "launch.sh: -R and -w must be integers (>= 0, >= 1), got '$RESTARTS', '$WINDOW'" >&2
    exit 2
  fi
  if [ "$TRANSPORT" != tcp ]; then
    echo "launch.sh: -R needs -X tcp: a restarted process cannot rejoin the MPI job's data plane" >&2
    exit 2
  fi
  if [ -n "$TPCOMM" ] && [ "$TPCOMM" != tcp ] && [ "$TPCOMM" != auto ]; then
    echo "launch.sh: -R needs the TP groups on TCP (-M tcp or auto), got '-M $TPCOMM'" >&2
    exit 2
  fi
fi
if [ -n "$HOSTFILE" ] && [ ! -r "$HOSTFILE" ]; then
  echo "launch.sh: cannot read hostfile '$HOSTFILE'" >&2
  exit 2
fi
if [ -n "$HOSTFILE" ] && [ "$COORD" = 127.0.0.1 ]; then
  echo "launch.sh: with -H, -c must name the coordinator's host (the hostfile's first host)" >&2
  exit 2
fi

# --bind-to none: a worker runs an engine thread pool and transport threads; the
# default one-core-per-rank binding would put them all on one core.
args=(--allow-run-as-root --oversubscribe --bind-to none --enable-recovery)
[ -n "$HOSTFILE" ] && args+=(--hostfile "$HOSTFILE")

# Exported for the per-rank wrappers below.
export KVR_TP="$T" KVR_TPBASE=$((CONTROL + 1)) KVR_COORD="$COORD" KVR_MULTIHOST="${HOSTFILE:+1}"
export KVR_RESTARTS="$RESTARTS" KVR_WINDOW="$WINDOW" KVR_DDEV="$DDEV"
args+=(-x KVR_TP -x KVR_TPBASE -x KVR_COORD -x KVR_MULTIHOST -x KVR_RESTARTS -x KVR_WINDOW -x KVR_DDEV)

# Runs on every rank's host before the binary: the address to listen on and
# advertise. On one machine that is loopback; across hosts, the coordinator
# binds what its name resolves to and a worker takes the source address of its
# route to the coordinator.
read -r -d '' ADDR <<'EOF' || true
kvr_resolve() { getent ahostsv4 "$1" | awk '{print $1; exit}'; }
kvr_addr() {
  [ -z "$KVR_MULTIHOST" ] && { echo 127.0.0.1; return; }
  local ip; ip=$(kvr_resolve "$KVR_COORD")
  [ -z "$ip" ] && { echo "launch.sh: cannot resolve coordinator host '$KVR_COORD' on $(hostname)" >&2; return 1; }
  if [ "$1" = coordinator ]; then echo "$ip"; return; fi
  local src; src=$(ip -o route get "$ip" 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')
  [ -z "$src" ] && src=$(hostname -I 2>/dev/null | awk '{print $1}')
  [ -z "$src" ] && { echo "launch.sh: no address routes to $KVR_COORD on $(hostname)" >&2; return 1; }
  echo "$src"
}
# kvr_run NAME CMD...: without -R, exec CMD. With -R, supervise it: forward
# TERM/INT to it; when it exits non-zero (and no stop was asked), start it
# again outside MPI after a backoff, at most KVR_RESTARTS times per KVR_WINDOW
# seconds. setpriv --pdeathsig: CMD dies with its supervisor.
kvr_run() {
  local name=$1; shift
  [ -z "$KVR_RESTARTS" ] && exec "$@"
  local stop=0 child="" rc first=1 now t ms i strip=() times=() kept=()
  for v in $(compgen -e); do case $v in OMPI_*|PMIX_*) strip+=(-u "$v") ;; esac; done
  trap 'stop=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
  while :; do
    if [ "$first" = 1 ]; then setpriv --pdeathsig TERM "$@" &
    else env "${strip[@]}" setpriv --pdeathsig TERM "$@" &
    fi
    child=$! first=0
    while :; do wait "$child" && rc=0 || rc=$?; kill -0 "$child" 2>/dev/null || break; done
    child=""
    if [ "$stop" = 1 ] || [ "$rc" = 0 ]; then exit "$rc"; fi
    now=$(date +%s) kept=()
    for t in "${times[@]}"; do [ $((now - t)) -lt "$KVR_WINDOW" ] && kept+=("$t"); done
    times=("${kept[@]}")
    if [ "${#times[@]}" -ge "$KVR_RESTARTS" ]; then
      echo "launch.sh: $name exited with status $rc; restarted ${#times[@]} times within $KVR_WINDOW s, giving up" >&2
      exit "$rc"
    fi
    ms=250; for ((i = 0; i < ${#times[@]} && ms < 8000; i++)); do ms=$((ms * 2)); done
    [ "$ms" -gt 8000 ] && ms=8000
    times+=("$now")
    echo "launch.sh: $name exited with status $rc; restarting in $ms ms (restart ${#times[@]} of at most $KVR_RESTARTS within $KVR_WINDOW s)" >&2
    sleep "$((ms / 1000)).$(printf %03d $((ms % 1000)))" & wait $! || true
    [ "$stop" = 1 ] && exit "$rc"
  done
}
EOF

key=()
if "$BIN/kvrelay-coordinator" --cluster-key-file /dev/null --help >/dev/null 2>&1; then
  if [ -z "$KEYFILE" ]; then
    KEYFILE=$(mktemp "${TMPDIR:-/tmp}/kvrelay-launch-key.XXXXXX")  # mode 0600
    trap 'rm -f "$KEYFILE"' EXIT
    od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$KEYFILE"
  fi
  key=(--cluster-key-file "$(realpath "$KEYFILE")")
elif [ -n "$KEYFILE" ]; then
  echo "launch.sh: -K given but $BIN/kvrelay-coordinator has no --cluster-key-file" >&2
  exit 2
fi

transport=()
[ -n "$TRANSPORT" ] && transport=(--kv-transport "$TRANSPORT")
[ -n "$KVTIMEOUT" ] && transport+=(--kv-timeout-ms "$KVTIMEOUT")
[ -n "$TPCOMM" ] && transport+=(--tp-comm "$TPCOMM")
ctls=() wtls=()
if [ -n "$TLSDIR" ]; then
  for f in ca.crt coordinator.crt coordinator.key worker.crt worker.key; do
    [ -r "$TLSDIR/$f" ] || { echo "launch.sh: -S: cannot read $TLSDIR/$f (scripts/make-cluster-certs.sh DIR)" >&2; exit 2; }
  done
  TLSDIR=$(realpath "$TLSDIR")
  ctls=(--control-tls-cert "$TLSDIR/coordinator.crt" --control-tls-key "$TLSDIR/coordinator.key"
        --control-tls-ca "$TLSDIR/ca.crt")
  wtls=(--control-tls-cert "$TLSDIR/worker.crt" --control-tls-key "$TLSDIR/worker.key"
        --control-tls-ca "$TLSDIR/ca.crt")
fi
wargs=("${key[@]}" "${transport[@]}" "${wtls[@]}" "${wdeadlines[@]}")
pdev=(); [ "$PDEV" != cpu ] && pdev=(--device "$PDEV")

# mpirun runs as a child (not exec) so the EXIT trap can remove a generated
# key. It gets its own session: a TERM/INT for this script (or its process
# group, as Ctrl-C sends) reaches mpirun exactly once, through the trap; a
# second signal within 5 s would make mpirun exit at once and orphan its ranks.
# Its exit status is ours.
trap 'kill -TERM "$mpirun_pid" 2>/dev/null' TERM INT
setsid mpirun "${args[@]}" \
  -np 1 /bin/bash -c "$ADDR"'
    a=$(kvr_addr coordinator) || exit 1
    kvr_run coordinator "$@" --host "$a" --control-host "$a"' coordinator \
    "$BIN/kvrelay-coordinator" --model "$MODEL" --port "$PORT" --control-port "$CONTROL" \
    --kv-dtype "$KV" --heartbeat-ms "$HEARTBEAT" "${key[@]}" "${ctls[@]}" "${copts[@]}" : \
  -np "$P" /bin/bash -c "$ADDR"'
    a=$(kvr_addr worker) || exit 1
    kvr_run "prefill-$((OMPI_COMM_WORLD_RANK - 1))" "$@" --id "prefill-$((OMPI_COMM_WORLD_RANK - 1))" \
      --kv-host "$a" --advertise-host "$a" --rank "$OMPI_COMM_WORLD_RANK" --world-size "$OMPI_COMM_WORLD_SIZE"' prefill \
    "$BIN/kvrelay-prefill" --coordinator "$COORD:$CONTROL" --model "$MODEL" \
    --kv-dtype "$KV" --threads "$THREADS" "${wargs[@]}" "${pdev[@]}" : \
  -np "$((D * T))" /bin/bash -c "$ADDR"'
    a=$(kvr_addr worker) || exit 1
    i=$((OMPI_COMM_WORLD_RANK - 1 - $1)); g=$((i / $2)); r=$((i % $2)); shift 2
    id="decode-$g"; [ "$r" -gt 0 ] && id="$id-tp$r"
    tp=(); [ "$KVR_TP" -gt 1 ] && tp=(--tp-size "$KVR_TP" --tp-rank "$r" --tp-leader "127.0.0.1:$((KVR_TPBASE + g))")
    dev=(); [ "$KVR_DDEV" != cpu ] && dev=(--device "$KVR_DDEV")
    [ "$KVR_DDEV" = cuda ] && [ "$r" -gt 0 ] && dev=(--device "cuda:$r")
    kvr_run "$id" "$@" --id "$id" --kv-host "$a" --advertise-host "$a" "${tp[@]}" "${dev[@]}" \
      --rank "$OMPI_COMM_WORLD_RANK" --world-size "$OMPI_COMM_WORLD_SIZE"' decode "$P" "$T" \
    "$BIN/kvrelay-decode" --coordinator "$COORD:$CONTROL" --model "$MODEL" \
    --kv-dtype "$KV" --threads "$THREADS" "${wargs[@]}" &
mpirun_pid=$!
# wait returns early when a trapped signal arrives; wait again for the real end.
rc=0
while :; do
  wait "$mpirun_pid" && rc=0 || rc=$?
  kill -0 "$mpirun_pid" 2>/dev/null || break
done
exit "$rc"
