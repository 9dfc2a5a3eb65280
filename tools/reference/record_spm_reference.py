#!/usr/bin/env python3
"""Records llama.cpp's SentencePiece-BPE ("llama" vocabulary) tokenization as a
reference for kvrelay's SPM tokenizer.

No Llama-2-era model ships with the repository, so this builds a vocabulary-only
GGUF in that format from the default model's vocabulary: <unk> <s> </s>, the 256
<0xNN> byte tokens, then the first pieces of SmolLM2's vocabulary rewritten in
SentencePiece form (space -> U+2581), scored -rank. llama.cpp loads it with
vocab_only and tokenizes the corpus of record_llamacpp.py; both the GGUF and the
ids are written to tests/data/:

  tests/data/spm_vocab.gguf       the vocabulary (GGUF v3, no tensors)
  tests/data/spm_reference.json   {"text", "add_special", "parse_special", "ids"}...

Usage: .venv-reference/bin/python tools/reference/record_spm_reference.py
"""

import json
import os
import struct
import sys

import llama_cpp
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from record_llamacpp import CORPUS  # noqa: E402

N_PIECES = 6000

GGUF_UINT32, GGUF_INT32, GGUF_FLOAT32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY = 4, 5, 6, 7, 8, 9


def gguf_string(s):
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_kv(key, vtype, value):
    out = gguf_string(key) + struct.pack("<I", vtype)
    if vtype == GGUF_STRING:
        return out + gguf_string(value)
    if vtype == GGUF_UINT32:
        return out + struct.pack("<I", value)
    if vtype == GGUF_FLOAT32:
        return out + struct.pack("<f", value)
    if vtype == GGUF_BOOL:
        return out + struct.pack("<B", 1 if value else 0)
    if vtype == GGUF_ARRAY:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        for it in items:
            if etype == GGUF_STRING:
                out += gguf_string(it)
            elif etype == GGUF_INT32:
                out += struct.pack("<i", it)
            elif etype == GGUF_FLOAT32:
                out += struct.pack("<f", it)
        return out
    raise ValueError(vtype)


def byte_level_decoder():
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(0x100 + n)] = b
            n += 1
    return table


def main():
    model = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    src = Llama(model_path=model, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(src.model)
    dec = byte_level_decoder()

    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    seen = set(tokens)
    pieces = []
    for i in range(17, src.n_vocab()):
        text = llama_cpp.llama_vocab_get_text(vocab, i).decode("utf-8")
        try:
            raw = bytes(dec[c] for c in text).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if not raw or any(ord(c) < 0x20 for c in raw):
            continue
        piece = raw.replace(" ", "\u2581")
        if piece in seen:
            continue
        seen.add(piece)
        pieces.append(piece)
        if len(pieces) == N_PIECES:
            break
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(r) for r in range(len(pieces))]

    kvs = [
        gguf_kv("general.architecture", GGUF_STRING, "llama"),
        gguf_kv("general.name", GGUF_STRING, "kvrelay-spm-test-vocab"),
        gguf_kv("llama.context_length", GGUF_UINT32, 2048),
        gguf_kv("llama.embedding_length", GGUF_UINT32, 64),
        gguf_kv("llama.block_count", GGUF_UINT32, 1),
        gguf_kv("llama.feed_forward_length", GGUF_UINT32, 128),
        gguf_kv("llama.attention.head_count", GGUF_UINT32, 4),
        gguf_kv("llama.attention.head_count_kv", GGUF_UINT32, 4),
        gguf_kv("llama.rope.dimension_count", GGUF_UINT32, 16),
        gguf_kv("llama.attention.layer_norm_rms_epsilon", GGUF_FLOAT32, 1e-5),
        gguf_kv("tokenizer.ggml.model", GGUF_STRING, "llama"),
        gguf_kv("tokenizer.ggml.tokens", GGUF_ARRAY, (GGUF_STRING, tokens)),
        gguf_kv("tokenizer.ggml.scores", GGUF_ARRAY, (GGUF_FLOAT32, scores)),
        gguf_kv("tokenizer.ggml.token_type", GGUF_ARRAY, (GGUF_INT32, types)),
        gguf_kv("tokenizer.ggml.bos_token_id", GGUF_UINT32, 1),
        gguf_kv("tokenizer.ggml.eos_token_id", GGUF_UINT32, 2),
        gguf_kv("tokenizer.ggml.unknown_token_id", GGUF_UINT32, 0),
        gguf_kv("tokenizer.ggml.add_bos_token", GGUF_BOOL, True),
    ]
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
    blob += b"\0" * ((-len(blob)) % 32)
    gguf_path = os.path.join(ROOT, "tests", "data", "spm_vocab.gguf")
    with open(gguf_path, "wb") as f:
        f.write(blob)

    spm = Llama(model_path=gguf_path, vocab_only=True, verbose=False)
    entries = []
    for text in CORPUS:
        for add_special, parse_special in ((False, False), (True, True), (False, True)):
            ids = spm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
            entries.append({"text": text, "add_special": add_special, "parse_special": parse_special,
                            "ids": [int(i) for i in ids]})
    out = {"vocab": "tests/data/spm_vocab.gguf", "n_tokens": len(tokens),
           "llama_cpp_python_version": llama_cpp.__version__,
           "settings": "vocab_only; llama_tokenize(text, add_special, parse_special)",
           "tokenization": entries}
    out_path = os.path.join(ROOT, "tests", "data", "spm_reference.json")
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {gguf_path} ({len(blob)} bytes), {out_path} ({len(entries)} cases)", file=sys.stderr)


if __name__ == "__main__":
    main()
