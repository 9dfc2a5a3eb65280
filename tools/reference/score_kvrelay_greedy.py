#!/usr/bin/env python3
"""llama.cpp scores kvrelay's greedy continuations.

For every plain prompt of a reference file written by record_llamacpp.py, runs
`kvrelay generate --json` (greedy, --max-tokens N), checks that kvrelay's prompt
ids are the recorded ones, then lets llama.cpp evaluate prompt + kvrelay's
tokens in one batch (f32 KV cache, flash attention off, as the recording; with
the recording's step_tokens > 2 the last positions are evaluated again as one
batch, so every position has llama.cpp's prompt-pass arithmetic, see
record_llamacpp.eval_prompt_pass) and counts the positions where llama.cpp's
argmax is kvrelay's next token. Prints one line per prompt and the total; the
numbers are llama.cpp's judgement of kvrelay's output (nothing is written).

  /root/.cache/kvrelay-ref-venv/bin/python tools/reference/score_kvrelay_greedy.py \\
      --model models/gemma-3-270m-q4_k_m.gguf --ref tests/data/llamacpp_reference_gemma3.json
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from llama_cpp import Llama

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record_llamacpp import eval_prompt_pass  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--kvrelay", default=os.path.join(ROOT, "build", "cli", "kvrelay"))
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    ref = json.load(open(args.ref, encoding="utf-8"))
    step_tokens = ref["settings"].get("step_tokens", 2)
    llm = Llama(model_path=args.model, n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2,
                n_threads_batch=2, logits_all=True, seed=0, verbose=False, flash_attn=False,
                type_k=0, type_v=0)
    total = agree = 0
    for g in ref["greedy"]:
        if g["kind"] != "plain":
            continue
        out = subprocess.run([args.kvrelay, "generate", "--model", args.model, "--prompt", g["text"],
                              "--max-tokens", str(args.tokens), "--json", "--threads", "2"],
                             check=True, capture_output=True, text=True).stdout
        res = json.loads(out)
        if res["prompt_ids"] != g["prompt_ids"]:
            sys.exit(f"kvrelay's prompt ids differ from the recording for {g['text']!r}")
        gen = res["token_ids"]
        seq = res["prompt_ids"] + gen
        scores = eval_prompt_pass(llm, seq[:-1], step_tokens)
        n0 = len(res["prompt_ids"]) - 1
        ok = sum(1 for i, t in enumerate(gen) if int(np.argmax(scores[n0 + i])) == t)
        total += len(gen)
        agree += ok
        print(f"{len(res['prompt_ids'])} prompt tokens: llama.cpp argmax = kvrelay token at "
              f"{ok}/{len(gen)} positions")
    print(f"total: {agree}/{total} = {100.0 * agree / max(total, 1):.2f}%")


if __name__ == "__main__":
    main()
