#!/usr/bin/env python3
"""Records llama.cpp reference data for kvrelay's conformance tests.

llama.cpp (through llama-cpp-python) is the independent implementation kvrelay is
checked against. This script loads the default model and writes
tests/data/llamacpp_reference.json with:

  tokenization  ids for a corpus of tricky strings (whitespace runs, digits, code,
                emoji, CJK, RTL scripts, contractions, special tokens, long text),
                for each (add_special, parse_special) combination used by kvrelay.
  chat          the model's chat template rendered by jinja2 (the engine Hugging
                Face uses) for a few conversations.
  logits        for each prompt, at every position: the top-32 (id, logit), the
                logits at the fixed "probe_ids", and the top-1/top-2 margin.
  greedy        64 greedily generated ids per prompt (argmax of the logits, ties to
                the lowest id; no repeat penalty; no BOS beyond what the prompt has)
                and the smallest top-1/top-2 margin seen while generating, both
                with prompt-pass arithmetic at every step ("generated") and with
                llama.cpp's one-token decode steps ("generated_one_token_steps");
                see greedy().

  long          (--long-prompt-tokens N) one prompt of N tokens cut from
                tests/data/kjv_genesis_exodus.txt, longer than a sliding window:
                llama.cpp's argmax and top-1/top-2 margin at every position, and
                64 greedy ids after it (both kinds of steps, as "greedy").

Usage (see setup_venv.sh):
  .venv-reference/bin/python tools/reference/record_llamacpp.py [--model M] [--out F]
      [--tokenization-only] [--kv-type f32|f16] [--prompt-bos] [--long-prompt-tokens N]
      [--step-tokens S]

Gemma 3 270M (tests/data/llamacpp_reference_gemma3.json):
  ... record_llamacpp.py --model models/gemma-3-270m-q4_k_m.gguf \
      --out tests/data/llamacpp_reference_gemma3.json --prompt-bos --long-prompt-tokens 700 \
      --step-tokens 8
--prompt-bos starts every prompt with BOS (Gemma expects it; the default model's
recording has none). A model without a chat template gets no chat prompts.
--step-tokens 8 gives every recorded position llama.cpp's prompt-pass arithmetic
on a K-quant model (see greedy(); the default model's recording used 2).

The forward passes run with flash attention off and an f32 KV cache by default
(the settings are written to the file's "settings" object).

--tokenization-only loads only the vocabulary and rewrites the "tokenization" and
"chat" sections of an existing --out file, keeping its logits and greedy data.
(llama.cpp's CPU threads spin at barriers, so the forward passes crawl on a
heavily oversubscribed machine; record those when it is quiet.)
"""

import argparse
import hashlib
import json
import os
import random
import sys

import numpy as np
import jinja2
import llama_cpp
from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

N_CTX = 1024
N_BATCH = 1024
N_THREADS = 2
TOP_K = 32
N_PROBES = 64
PROBE_SEED = 20261129
N_GREEDY = 64
# ggml_type ids accepted for the KV cache. f32 is the default since the f16
# cache makes llama.cpp round Q, K, V and the softmax weights to fp16 inside
# attention (the K*Q and V*softmax products run at the cache's vec_dot type),
# which on this model moves logits by up to ~2 from llama.cpp's own f32-cache
# result; kvrelay's reference comparison runs at KvDtype::kF32.
KV_TYPES = {"f32": 0, "f16": 1}

LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog. " * 6
    + "In 1969, Apollo 11 landed on the Moon; Neil Armstrong said: \"That's one small step "
    "for [a] man, one giant leap for mankind.\"\n\nTokenizers split text into pieces, "
    "merge byte pairs by rank, and map each piece to an id. Edge cases matter:   spaces,\t"
    "tabs,\r\nCRLF line ends, numbers like 3.14159 and 1,000,000, and symbols such as "
    "<=>, ->, ::, &&, ||, != and ==."
)

CORPUS = [
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n\n",
    "   leading spaces",
    "trailing spaces   ",
    "  both  ",
    "Hello world",
    " Hello world",
    "Hello  world",
    "Hello\tworld\n",
    "line one\nline two\n\nline four\r\nend",
    "12345678",
    "3.14159",
    "1,000,000",
    "Room 101 costs $42.50 (or 40\u20ac) in 2024.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "#include <vector>\nint main() {\n  std::vector<int> v{1, 2, 3};\n  for (auto& x : v) { x <<= 1; }\n  return v[0] != 2 ? -1 : 0;\n}\n",
    "if (a && b || !c) { x->y = z::w; i++; j--; k += 3; }",
    "I don't know, I'M sure you'll see what they've done, it's John's.",
    "DON'T SHOUT, we'd rather you didn't",
    "Emoji: \U0001F600\U0001F680\u2764\ufe0f",
    "Family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 and flags \U0001F1EB\U0001F1F7\U0001F1EF\U0001F1F5",
    "\U0001F44D\U0001F3FD skin tone",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca",
    "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc785\ub2c8\ub2e4",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe \u00e5\u00e6\u00f8",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043a\u0430\u043a \u0434\u0435\u043b\u0430? \u0401\u0436\u0438\u043a",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0393\u03b5\u03b9\u03b1 \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<|endoftext|>",
    "not special: <|im_start  and <im_end|>",
    "http://example.com/path?query=1&x=%20#frag",
    "user@example.com, @handle #hashtag",
    "a\u00a0b\u2003c\u3000d",
    "...!!!???---___***",
    "x" * 40,
    "\n \n\t \r\n\r\n  x  \n",
    "a\n  b\n\n\n   c",
    "'s 'S 're 'RE o'clock rock'n'roll",
    "\u0661\u0662\u0663 \u2160\u216b \u00bd\u00be 10\u00b2",
    "e\u0301t\u00e9 n\u0303 \u0915\u093f",
    "tab\u000bvt\u0085nel\u2028ls",
    "\U0001F9D1\u200d\U0001F4BB\U0001F3F3\ufe0f\u200d\U0001F308 \u2764",
    "mixed\u4e2d\u6587English\u0420\u0443\u0441123abc",
    "ctrl\x04\x06\x13\x14\x16\x1d chars\x00nul\x7fdel",
    LONG_TEXT,
]

PLAIN_PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The three primary colors are red, yellow and blue. Mixing red and blue gives purple; "
    "mixing yellow and blue gives green; mixing red and yellow gives orange. In painting, "
    "artists often use a limited palette to create harmony. A common exercise is to paint "
    "a landscape using only these three colors plus white. The result shows how",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three fruits."}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "user", "content": "What is 12 times 12?"},
     {"role": "assistant", "content": "12 times 12 is 144."},
     {"role": "user", "content": "And 13 times 13?"}],
    [{"role": "system", "content": "You translate English to French."},
     {"role": "user", "content": "Good morning, how are you today?"}],
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def render_chat(template, messages, add_generation_prompt):
    if not template:
        return ""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token="", eos_token="<|im_end|>")


def r4(x):
    return round(float(x), 4)


def top2_margin(row):
    two = np.partition(row, -2)[-2:]
    return float(two.max() - two.min())


def record_tokenization(llm, out):
    """Fills out["tokenization"] (llama.cpp ids of the corpus) and out["chat"]."""
    tok = []
    for text in CORPUS:
        for add_special, parse_special in ((False, False), (True, True), (False, True)):
            ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
            tok.append({"text": text, "add_special": add_special, "parse_special": parse_special,
                        "ids": [int(i) for i in ids]})
    out["tokenization"] = tok

    template = llm.metadata.get("tokenizer.chat_template", "")
    chat = []
    for conv in CHAT_CONVERSATIONS:
        for agp in (True, False):
            chat.append({"messages": conv, "add_generation_prompt": agp,
                         "text": render_chat(template, conv, agp)})
    out["chat"] = {"renderer": "jinja2 " + jinja2.__version__ + " (trim_blocks, lstrip_blocks)",
                   "template": template, "renderings": chat}


def eval_prompt_pass(llm, ids, step_tokens):
    """Evaluates `ids` from an empty cache; returns the logits of every position.

    With step_tokens > 2 the last step_tokens positions are evaluated once
    more, as one batch of step_tokens: llama.cpp's repacked Q4_K kernel
    (ggml_gemm_q4_K_8x8_q8_K) serves rows in groups of four and leaves the
    len(ids) % 4 last rows of a batch to its one-row kernel, which sums in
    another order. Re-evaluated in a batch of 8, those rows get the arithmetic
    every other row of the prompt pass had (see greedy()).
    """
    llm.reset()
    llm.eval(ids)
    if step_tokens > 2 and len(ids) % 4 != 0:
        if len(ids) < step_tokens:
            sys.exit(f"a prompt of {len(ids)} tokens is shorter than --step-tokens {step_tokens}")
        llm.n_tokens -= step_tokens
        llm.eval(ids[-step_tokens:])
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def greedy(llm, ids, step_tokens):
    """N_GREEDY argmax tokens after `ids`, and the smallest top-2 margin seen.

    llama.cpp's CPU backend is not batch-invariant: the arithmetic of a row
    depends on how many rows its batch has. For a batch of one token its
    sgemm path (which needs 2+ columns) is skipped, so V * softmax falls back
    to vec_dot_f32 with another summation order; on K-quant models the
    repacked Q4_K kernel sums groups of 4 rows in another order than single
    rows, and Q6_K goes through the tiled matmul only for batches of 8+ rows.
    With step_tokens = S >= 2, every step evaluates the previous S - 1 tokens
    again together with the new one (the cache is cut back first), so every
    position is computed by the same arithmetic as the prompt pass: these are
    the logits of one full causal pass over the sequence. S = 2 suffices for
    the default model (Q4_1 / Q8_0); Gemma 3's Q4_K_M file needs S = 8 (a
    multiple of 4, and 8 rows). With step_tokens = 1 each new token is
    evaluated alone, as ordinary llama.cpp decoding does.
    """
    if step_tokens > 1:
        last = eval_prompt_pass(llm, ids, step_tokens)[-1]
    else:
        llm.reset()
        llm.eval(ids)
        last = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
    gen, min_margin = [], float("inf")
    seq = list(ids)
    for _ in range(N_GREEDY):
        nxt = int(np.argmax(last))
        min_margin = min(min_margin, top2_margin(last))
        gen.append(nxt)
        seq.append(nxt)
        if step_tokens > 1:
            llm.n_tokens -= step_tokens - 1
            llm.eval(seq[-step_tokens:])
        else:
            llm.eval([nxt])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return gen, min_margin


def write(out, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "llamacpp_reference.json"))
    ap.add_argument("--tokenization-only", action="store_true")
    ap.add_argument("--kv-type", choices=sorted(KV_TYPES), default="f32",
                    help="llama.cpp KV cache type for K and V (default f32: see below)")
    ap.add_argument("--prompt-bos", action="store_true",
                    help="start every logits/greedy prompt with the BOS token")
    ap.add_argument("--long-prompt-tokens", type=int, default=0,
                    help="also record one prompt of this many tokens (a 'long' section)")
    ap.add_argument("--step-tokens", type=int, default=2,
                    help="tokens per greedy step for 'generated' (prompt-pass arithmetic; "
                         "see greedy(); 8 for K-quant models)")
    args = ap.parse_args()

    if args.tokenization_only:
        with open(args.out, encoding="utf-8") as f:
            out = json.load(f)
        if out.get("model_sha256") != sha256_file(args.model):
            sys.exit("the model differs from the one the existing data was recorded with")
        llm = Llama(model_path=args.model, vocab_only=True, verbose=False)
        record_tokenization(llm, out)
        write(out, args.out)
        return

    n_ctx = max(N_CTX, args.long_prompt_tokens + N_GREEDY + 8)
    llm = Llama(model_path=args.model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                n_threads=N_THREADS, n_threads_batch=N_THREADS, logits_all=True,
                seed=0, verbose=False, flash_attn=False,
                type_k=KV_TYPES[args.kv_type], type_v=KV_TYPES[args.kv_type])
    n_vocab = llm.n_vocab()
    template = llm.metadata.get("tokenizer.chat_template", "")

    out = {
        "model": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "llama_cpp_python_version": llama_cpp.__version__,
        "settings": {
            "n_ctx": n_ctx, "n_batch": n_ctx, "n_ubatch": n_ctx, "n_threads": N_THREADS,
            "step_tokens": args.step_tokens,
            "prompt_bos": args.prompt_bos,
            "logits_all": True, "kv_cache_type": args.kv_type, "flash_attn": False,
            "backend": "CPU",
            "tokenize": "llama_tokenize(text, add_special, parse_special)",
            "greedy": "argmax over raw logits (ties -> lowest id), repeat_penalty 1.0, "
                      "no BOS added (the prompt ids are evaluated as recorded); "
                      f"'generated': each step evaluates the previous {args.step_tokens - 1} "
                      f"token(s) and the new one as one {args.step_tokens}-token batch "
                      "(prompt-pass arithmetic at every position; with step_tokens > 2 the "
                      "last step_tokens prompt positions are evaluated again as one batch "
                      "when the prompt length is not a multiple of 4); "
                      "'generated_one_token_steps': each new token alone (llama.cpp's "
                      "ordinary decoding, whose attention sums in another order)",
            "logits_rounding": "4 decimals",
        },
    }

    record_tokenization(llm, out)

    rng = random.Random(PROBE_SEED)
    probe_ids = sorted(rng.sample(range(n_vocab), N_PROBES))
    out["probe_ids"] = probe_ids

    prompts = [{"kind": "plain", "text": t} for t in PLAIN_PROMPTS]
    if template:
        prompts += [{"kind": "chat", "messages": c, "text": render_chat(template, c, True)}
                    for c in CHAT_CONVERSATIONS]
    bos = [llm.token_bos()] if args.prompt_bos else []

    logits_out, greedy_out = [], []
    for p in prompts:
        ids = bos + [int(i) for i in llm.tokenize(p["text"].encode("utf-8"), add_bos=False,
                                                   special=True)]
        scores = eval_prompt_pass(llm, ids, args.step_tokens)
        positions, margins = [], []
        for row in scores:
            top = np.argsort(-row, kind="stable")[:TOP_K]
            positions.append({"top": [[int(i), r4(row[i])] for i in top],
                              "probe": [r4(row[i]) for i in probe_ids]})
            margins.append(r4(top2_margin(row)))
        entry = dict(p)
        entry["ids"] = ids
        entry["positions"] = positions
        entry["top2_margin"] = margins
        logits_out.append(entry)

        gen, min_margin = greedy(llm, ids, args.step_tokens)
        gen1, min_margin1 = greedy(llm, ids, 1)
        greedy_out.append({"kind": p["kind"], "text": p["text"], "prompt_ids": ids,
                           "generated": gen, "min_top2_margin": r4(min_margin),
                           "generated_one_token_steps": gen1,
                           "min_top2_margin_one_token_steps": r4(min_margin1)})
        print(f"prompt {len(greedy_out)}/{len(prompts)}: {len(ids)} tokens, "
              f"min margin {min_margin:.3f}, one-token steps agree on "
              f"{sum(1 for _ in __import__('itertools').takewhile(lambda t: t[0] == t[1], zip(gen, gen1)))}"
              f"/{N_GREEDY}", file=sys.stderr)

    out["logits"] = logits_out
    out["greedy"] = greedy_out

    if args.long_prompt_tokens > 0:
        with open(os.path.join(ROOT, "tests", "data", "kjv_genesis_exodus.txt"), encoding="utf-8") as f:
            text = f.read()
        ids = bos + [int(i) for i in llm.tokenize(text.encode("utf-8"), add_bos=False,
                                                   special=False)]
        ids = ids[: args.long_prompt_tokens]
        scores = eval_prompt_pass(llm, ids, args.step_tokens)
        gen, min_margin = greedy(llm, ids, args.step_tokens)
        gen1, min_margin1 = greedy(llm, ids, 1)
        out["long"] = {"source": "tests/data/kjv_genesis_exodus.txt, first tokens",
                       "ids": ids,
                       "argmax": [int(np.argmax(r)) for r in scores],
                       "top2_margin": [r4(top2_margin(r)) for r in scores],
                       "generated": gen, "min_top2_margin": r4(min_margin),
                       "generated_one_token_steps": gen1,
                       "min_top2_margin_one_token_steps": r4(min_margin1)}
        print(f"long prompt: {len(ids)} tokens, min margin {min_margin:.3f}", file=sys.stderr)

    write(out, args.out)


if __name__ == "__main__":
    main()
