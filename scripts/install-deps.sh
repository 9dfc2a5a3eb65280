#!/usr/bin/env bash
# Installs the Debian packages kvrelay builds against. Idempotent: does nothing
# (and needs no network) when every package is already installed.
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ ccache pkg-config
  libopenmpi-dev openmpi-bin
  librocksdb-dev
  libprotobuf-dev protobuf-compiler
  libboost-dev libboost-system-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libxxhash-dev libssl-dev
  openssl  # scripts/make-cluster-certs.sh and the control-plane TLS tests make certificates with it
  libicu-dev
  python3 python3-venv python3-yaml
  iproute2 util-linux  # ip, tc, nsenter, unshare: tests/multinode's emulated hosts
  prometheus  # promtool: the coordinator's /metrics is checked with `promtool check metrics`
  clang-format clang-tidy  # tests/docs: the format and clang-tidy checks (CONTRIBUTING.md)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "[deps] all ${#PACKAGES[@]} Debian packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "[deps] installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "[deps] done"
