"""Writes a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json)
from a GGUF file's vocabulary, merges and chat template, for clients that count
tokens with `transformers` (aiperf) while the hub is out of reach.

usage: gguf_tokenizer.py MODEL.gguf OUT_DIR

Only byte-level BPE vocabularies (tokenizer.ggml.model = gpt2) are handled; the
pre-tokenizer follows tokenizer.ggml.pre as kvrelay's own tokenizer does for
the pre-types it names (engine/tokenizer/pre_tokenizer.cc).
"""
import json
import os
import sys

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def field_value(reader, name):
    f = reader.fields.get(name)
    if f is None:
        return None
    if len(f.data) == 1 and f.types and f.types[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if f.types and f.types[0].name == "ARRAY":
        out = []
        for i in f.data:
            part = f.parts[i]
            out.append(bytes(part).decode("utf-8") if f.types[-1].name == "STRING" else int(part[0]))
        return out
    return f.parts[f.data[0]][0].item()


def main():
    path, out_dir = sys.argv[1], sys.argv[2]
    r = GGUFReader(path)
    kind = field_value(r, "tokenizer.ggml.model")
    if kind != "gpt2":
        sys.exit("gguf_tokenizer.py: tokenizer.ggml.model %r is not byte-level BPE" % kind)
    pre = field_value(r, "tokenizer.ggml.pre") or "default"
    tokens = field_value(r, "tokenizer.ggml.tokens")
    types = field_value(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field_value(r, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "gpt-2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        sys.exit("gguf_tokenizer.py: tokenizer.ggml.pre %r is not handled" % pre)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are special: never split, skipped when decoding.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    def token(key):
        i = field_value(r, key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
              field_value(r, "llama.context_length") or 8192,
              "bos_token": token("tokenizer.ggml.bos_token_id"),
              "eos_token": token("tokenizer.ggml.eos_token_id"),
              "unk_token": token("tokenizer.ggml.unknown_token_id"),
              "pad_token": token("tokenizer.ggml.padding_token_id"),
              "add_bos_token": bool(field_value(r, "tokenizer.ggml.add_bos_token") or False)}
    template = field_value(r, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=1)
    print("wrote %s: %d tokens, %d merges, pre-tokenizer %s" % (out_dir, len(tokens), len(merges), pre))


if __name__ == "__main__":
    main()
