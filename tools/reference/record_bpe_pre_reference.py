#!/usr/bin/env python3
"""Records llama.cpp's byte-level BPE tokenization under each pre-tokenizer
kvrelay supports (tokenizer.ggml.pre = gpt-2, default, llama-bpe, qwen2, smollm).

For each pre type it writes a vocabulary-only GGUF built from the first
N_TOKENS tokens of the default model (and the merges among them), has llama.cpp
tokenize the corpus of record_llamacpp.py with it, and stores the ids. The files
differ only in tokenizer.ggml.pre, so one is kept (with pre = smollm); the test
loads it and swaps the pre-tokenizer:

  tests/data/bpe_vocab.gguf
  tests/data/bpe_pre_reference.json   {"<pre>": [{"text", "add_special", "parse_special", "ids"}...]}

Usage: .venv-reference/bin/python tools/reference/record_bpe_pre_reference.py
"""

import json
import os
import shutil
import struct
import sys
import tempfile

import llama_cpp
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from record_llamacpp import CORPUS  # noqa: E402
from record_spm_reference import (GGUF_ARRAY, GGUF_FLOAT32, GGUF_INT32,  # noqa: E402
                                  GGUF_STRING, GGUF_UINT32, gguf_kv)

N_TOKENS = 8000
PRES = ["gpt-2", "default", "llama-bpe", "qwen2", "smollm"]


def read_gguf_metadata(path):
    """Minimal GGUF v3 metadata reader (strings, ints, arrays of those)."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("<Q")
        s = data[pos:pos + n].decode("utf-8", errors="surrogateescape")
        pos += n
        return s

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q",
              11: "<q", 12: "<d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    assert data[:4] == b"GGUF"
    pos = 4
    take("<I")
    take("<Q")
    n_kv = take("<Q")
    meta = {}
    for _ in range(n_kv):
        k = string()
        meta[k] = value(take("<I"))
    return meta


def main():
    model = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    meta = read_gguf_metadata(model)
    tokens = meta["tokenizer.ggml.tokens"][:N_TOKENS]
    types = meta["tokenizer.ggml.token_type"][:N_TOKENS]
    kept = set(tokens)
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        left, right = m.split(" ", 1)
        if left in kept and right in kept and left + right in kept:
            merges.append(m)

    out = {"n_tokens": N_TOKENS, "n_merges": len(merges),
           "llama_cpp_python_version": llama_cpp.__version__,
           "settings": "vocab_only; llama_tokenize(text, add_special, parse_special); "
                       "no add_bos_token key (llama.cpp's per-pre default applies)"}
    tmp = tempfile.mkdtemp()
    for pre in PRES:
        kvs = [
            gguf_kv("general.architecture", GGUF_STRING, "llama"),
            gguf_kv("general.name", GGUF_STRING, "kvrelay-bpe-test-vocab-" + pre),
            gguf_kv("llama.context_length", GGUF_UINT32, 2048),
            gguf_kv("llama.embedding_length", GGUF_UINT32, 64),
            gguf_kv("llama.block_count", GGUF_UINT32, 1),
            gguf_kv("llama.feed_forward_length", GGUF_UINT32, 128),
            gguf_kv("llama.attention.head_count", GGUF_UINT32, 4),
            gguf_kv("llama.attention.head_count_kv", GGUF_UINT32, 4),
            gguf_kv("llama.rope.dimension_count", GGUF_UINT32, 16),
            gguf_kv("llama.attention.layer_norm_rms_epsilon", GGUF_FLOAT32, 1e-5),
            gguf_kv("tokenizer.ggml.model", GGUF_STRING, "gpt2"),
            gguf_kv("tokenizer.ggml.pre", GGUF_STRING, pre),
            gguf_kv("tokenizer.ggml.tokens", GGUF_ARRAY, (GGUF_STRING, tokens)),
            gguf_kv("tokenizer.ggml.token_type", GGUF_ARRAY, (GGUF_INT32, types)),
            gguf_kv("tokenizer.ggml.merges", GGUF_ARRAY, (GGUF_STRING, merges)),
            gguf_kv("tokenizer.ggml.bos_token_id", GGUF_UINT32, 1),
            gguf_kv("tokenizer.ggml.eos_token_id", GGUF_UINT32, 2),
        ]
        blob = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
        blob += b"\0" * ((-len(blob)) % 32)
        path = os.path.join(tmp, f"bpe_vocab_{pre}.gguf")
        with open(path, "wb") as f:
            f.write(blob)
        llm = Llama(model_path=path, vocab_only=True, verbose=False)
        entries = []
        for text in CORPUS:
            for add_special, parse_special in ((False, False), (True, True)):
                ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
                entries.append({"text": text, "add_special": add_special,
                                "parse_special": parse_special, "ids": [int(i) for i in ids]})
        out[pre] = entries
        if pre == "smollm":
            shutil.copyfile(path, os.path.join(ROOT, "tests", "data", "bpe_vocab.gguf"))
        print(f"{pre}: {len(entries)} cases", file=sys.stderr)

    shutil.rmtree(tmp)
    out_path = os.path.join(ROOT, "tests", "data", "bpe_pre_reference.json")
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
