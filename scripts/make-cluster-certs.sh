#!/usr/bin/env bash
# Makes a private CA and the certificates of one kvrelay cluster's control
# plane (mutual TLS 1.3, protocols/tls.h), with openssl:
#   DIR/ca.crt  DIR/ca.key                    the cluster CA (keep ca.key offline)
#   DIR/coordinator.crt  DIR/coordinator.key  the coordinator's (serverAuth + clientAuth)
#   DIR/worker.crt  DIR/worker.key            the workers' (one pair shared by all; or
#                                             -w NAME... for one pair per worker name)
# Keys are created mode 0600 (the binaries refuse a key others can read).
# The CA is dedicated to this cluster: the peers verify each other's
# certificate against it and check no host name, so anything it signs joins
# (and must still prove --cluster-key-file inside the TLS session).
#
#   scripts/make-cluster-certs.sh [-d days] [-n "DNS:coord.example,IP:10.0.0.1"] [-w "w1 w2"] DIR
# Use the files with:
#   kvrelay launch --control-tls-dir DIR ...
#   kvrelay-coordinator --control-tls-cert DIR/coordinator.crt --control-tls-key DIR/coordinator.key \
#                       --control-tls-ca DIR/ca.crt ...
#   kvrelay-{prefill,decode} --control-tls-cert DIR/worker.crt --control-tls-key DIR/worker.key \
#                            --control-tls-ca DIR/ca.crt ...
#   kubectl create secret generic kvrelay-control-tls --from-file=DIR/ca.crt \
#     --from-file=DIR/coordinator.crt --from-file=DIR/coordinator.key \
#     --from-file=DIR/worker.crt --from-file=DIR/worker.key      (deploy/k8s-tls)
set -euo pipefail

DAYS=365 SAN="" WORKERS=""
while getopts "d:n:w:" opt; do
  case $opt in
    d) DAYS=$OPTARG ;; n) SAN=$OPTARG ;; w) WORKERS=$OPTARG ;;
    *) echo "usage: $0 [-d days] [-n subjectAltNames] [-w \"worker names\"] DIR" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -eq 1 ] || { echo "usage: $0 [-d days] [-n subjectAltNames] [-w \"worker names\"] DIR" >&2; exit 2; }
DIR=$1
command -v openssl >/dev/null || { echo "make-cluster-certs.sh: openssl missing (apt-get install openssl)" >&2; exit 2; }
if [ -e "$DIR/ca.key" ]; then
  echo "make-cluster-certs.sh: $DIR/ca.key exists; refusing to overwrite a cluster CA" >&2
  exit 1
fi
mkdir -p "$DIR"
umask 077  # every file below, keys included, is created 0600
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
  -days "$DAYS" -subj "/CN=kvrelay cluster CA $(date -u +%Y%m%dT%H%M%SZ)" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -keyout "$DIR/ca.key" -out "$DIR/ca.crt" 2>/dev/null

# issue NAME: DIR/NAME.key + DIR/NAME.crt signed by the CA.
issue() {
  local name=$1 ext="$tmp/$1.ext"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "extendedKeyUsage=serverAuth,clientAuth"
    echo "subjectAltName=DNS:$name${SAN:+,$SAN}"
  } >"$ext"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
    -subj "/CN=$name" -keyout "$DIR/$name.key" -out "$tmp/$name.csr" 2>/dev/null
  openssl x509 -req -in "$tmp/$name.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" \
    -CAcreateserial -CAserial "$tmp/ca.srl" -days "$DAYS" -sha256 -extfile "$ext" \
    -out "$DIR/$name.crt" 2>/dev/null
  openssl verify -CAfile "$DIR/ca.crt" "$DIR/$name.crt" >/dev/null
}

issue coordinator
issue worker
for w in $WORKERS; do issue "$w"; done
chmod 644 "$DIR"/*.crt
echo "make-cluster-certs.sh: CA and certificates in $DIR (valid $DAYS days): $(cd "$DIR" && ls | tr '\n' ' ')"
