#!/usr/bin/env python3
"""Dumps llama.cpp's intermediate tensors of one forward pass (for finding
where kvrelay's arithmetic first leaves llama.cpp's).

Installs a ggml eval callback (llama_context_params.cb_eval, as llama.cpp's
llama-eval-callback tool does) in llama-cpp-python and writes every contiguous
f32 tensor the graph computes to OUT/<name>.npy, shaped [ne3, ne2, ne1, ne0]
(for a layer's activations: [1, 1, tokens, width]); names are llama.cpp's
graph names, e.g. attn_norm-3, kqv_out-3, ffn_gate-3, ffn_geglu-3, ffn_out-3,
l_out-3. The settings are record_llamacpp.py's (f32 KV cache, flash attention
off, 2 threads, every row an output). The callback splits the graph at every
node it asks for; the logits are checked to be the ones of a run without it.

  /root/.cache/kvrelay-ref-venv/bin/python tools/reference/dump_llamacpp_tensors.py \\
      --model models/gemma-3-270m-q4_k_m.gguf --ref tests/data/llamacpp_reference_gemma3.json \\
      --section long --tokens 120 --out /tmp/llama-dump [--names l_out,ffn_out]

Compare a dump with the same tensors of kvrelay's forward pass (ForwardPass in
engine/runtime/forward.cc: x_ after a layer is l_out, proj_ before the
post-FFN norm is ffn_out, gate_ after the GeGLU is ffn_geglu) element for
element; the first layer and tensor whose rows differ is the op to look at.
"""

import argparse
import ctypes
import json
import os
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama, _internals


class GgmlTensor(ctypes.Structure):
    # struct ggml_tensor of the ggml inside llama-cpp-python 0.3.36 (ggml.h):
    # GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64.
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
                ("padding", ctypes.c_char * 8)]


GGML_TYPE_F32 = 0


def make_llm(model, callback):
    orig = _internals.LlamaContext.__init__

    def patched(self, *, model, params, verbose=True):
        if callback is not None:
            params.cb_eval = callback
        orig(self, model=model, params=params, verbose=verbose)

    _internals.LlamaContext.__init__ = patched
    try:
        return Llama(model_path=model, n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2,
                     n_threads_batch=2, logits_all=True, seed=0, verbose=False, flash_attn=False,
                     type_k=0, type_v=0)
    finally:
        _internals.LlamaContext.__init__ = orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ref", required=True, help="a reference file of record_llamacpp.py")
    ap.add_argument("--section", default="long",
                    help="'long', or 'logits:N' for the N-th recorded prompt")
    ap.add_argument("--tokens", type=int, default=0, help="only the first N ids (0: all)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--names", default="",
                    help="comma-separated tensor base names (before '-layer'); default all")
    args = ap.parse_args()

    ref = json.load(open(args.ref, encoding="utf-8"))
    if args.section == "long":
        ids = ref["long"]["ids"]
    elif args.section.startswith("logits:"):
        ids = ref["logits"][int(args.section.split(":")[1])]["ids"]
    else:
        sys.exit(f"unknown --section {args.section}")
    if args.tokens > 0:
        ids = ids[: args.tokens]
    os.makedirs(args.out, exist_ok=True)
    want = set(n for n in args.names.split(",") if n)
    written = []

    def on_tensor(t, ask, _user):
        tensor = ctypes.cast(t, ctypes.POINTER(GgmlTensor)).contents
        name = tensor.name.decode(errors="replace")
        if ask:
            return not want or name.split("-")[0] in want
        ne, nb = list(tensor.ne), list(tensor.nb)
        if tensor.type == GGML_TYPE_F32 and nb[1] == 4 * ne[0] and nb[2] == nb[1] * ne[1] and \
                nb[3] == nb[2] * ne[2] and "/" not in name:
            n = ne[0] * ne[1] * ne[2] * ne[3]
            a = np.ctypeslib.as_array(ctypes.cast(tensor.data, ctypes.POINTER(ctypes.c_float)),
                                      shape=(n,)).copy()
            np.save(os.path.join(args.out, name + ".npy"), a.reshape(ne[3], ne[2], ne[1], ne[0]))
            written.append(name)
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_tensor)
    llm = make_llm(args.model, callback)
    llm.reset()
    llm.eval(ids)
    dumped = np.array(llm.scores[: len(ids)], dtype=np.float32)
    del llm
    plain = make_llm(args.model, None)
    plain.reset()
    plain.eval(ids)
    same = np.array_equal(dumped, np.array(plain.scores[: len(ids)], dtype=np.float32))
    print(f"{len(written)} tensors of {len(ids)} tokens in {args.out}; logits "
          f"{'identical to' if same else 'DIFFER from'} a run without the callback",
          file=sys.stderr)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
