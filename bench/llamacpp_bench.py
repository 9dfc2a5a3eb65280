"""One llama.cpp measurement run (via llama-cpp-python), the counterpart of
`kvrelay bench engine --reps 1`: pp<P> (one prompt of P random tokens in one
batch, logits of the last token only) and tg<G> (G tokens one at a time from an
empty context), each timed once after one untimed warm-up run.
Prints: pp<P> <tok/s> tg<G> <tok/s>
"""
import argparse
import random
import time

import llama_cpp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=max(a.pp, a.tg) + 16, n_batch=max(a.pp, a.tg),
                          n_ubatch=a.pp, n_threads=a.threads, n_threads_batch=a.threads,
                          logits_all=False, verbose=False)
    rng = random.Random(a.seed)
    vocab = llm.n_vocab()

    def pp_once():
        toks = [rng.randrange(vocab) for _ in range(a.pp)]
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(toks)
        return time.perf_counter() - t0

    def tg_once():
        llm.reset()
        tok = rng.randrange(vocab)
        t0 = time.perf_counter()
        for _ in range(a.tg):
            llm.eval([tok])
            tok = int(llm.scores[llm.n_tokens - 1].argmax())  # greedy, as kvrelay's bench
        return time.perf_counter() - t0

    pp_once()
    pp = a.pp / pp_once()
    tg_once()
    tg = a.tg / tg_once()
    print(f"pp{a.pp} {pp:.2f} tg{a.tg} {tg:.2f} llama_cpp_python {llama_cpp.__version__}")


if __name__ == "__main__":
    main()
