#!/usr/bin/env python3
"""llama.cpp on the same workloads as `vellum bench latency`, through
llama-cpp-python's low-level API (llama_batch / llama_decode), as llama.cpp's
own batched-bench drives it: B sequences, each a prompt of `input_len` random
ordinary tokens, then `output_len` greedy tokens per sequence, one batched
decode per step.

Prints one JSON object: prefill_tokens_per_s (prompt tokens / time to the
first tokens of every sequence), decode_tokens_per_s (tokens after the first /
the rest), avg_latency_s.
"""
import argparse
import ctypes
import json
import random
import sys
import time

import numpy as np

try:
    import llama_cpp
except ImportError:
    sys.exit("llama_cpp is not importable: run benchmarks/run.sh, which installs llama-cpp-python")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-iters", type=int, default=2)
    ap.add_argument("--num-iters-warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(a.model.encode(), mparams)
    if not model:
        sys.exit(f"llama.cpp could not load {a.model}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    B, I, O = a.batch_size, a.input_len, a.output_len
    per_seq = I + O + 8
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = per_seq * B
    cparams.n_batch = max(2048, B)
    cparams.n_ubatch = 512
    cparams.n_seq_max = B
    cparams.n_threads = a.threads
    cparams.n_threads_batch = a.threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        sys.exit("llama.cpp could not create a context")
    n_batch = cparams.n_batch

    batch = llama_cpp.llama_batch_init(max(n_batch, B), 0, B)
    rng = random.Random(a.seed)

    def decode(items):
        """items: list of (token, pos, seq, want_logits); in n_batch chunks.
        Returns the row index of each wanted logit in the last decode."""
        rows = []
        for start in range(0, len(items), n_batch):
            chunk = items[start:start + n_batch]
            batch.n_tokens = len(chunk)
            rows = []
            for i, (tok, pos, seq, want) in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if want else 0
                if want:
                    rows.append((seq, i))
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                sys.exit(f"llama_decode failed with {rc}")
        return rows

    def argmax_rows(rows):
        out = {}
        for seq, i in rows:
            ptr = llama_cpp.llama_get_logits_ith(ctx, i)
            arr = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
            out[seq] = int(arr.argmax())
        return out

    lat, first, dec = [], [], []
    mem = llama_cpp.llama_get_memory(ctx)
    for it in range(a.num_iters_warmup + a.num_iters):
        llama_cpp.llama_memory_clear(mem, True)
        prompts = [[100 + rng.randrange(n_vocab - 100) for _ in range(I)] for _ in range(B)]
        t0 = time.perf_counter()
        items = []
        for s, p in enumerate(prompts):
            for j, tok in enumerate(p):
                items.append((tok, j, s, j == I - 1))
        # Prompts in n_batch chunks; logits of each sequence's last prompt
        # token are read right after the chunk holding it.
        nxt = {}
        for start in range(0, len(items), n_batch):
            rows = decode(items[start:start + n_batch])
            nxt.update(argmax_rows(rows))
        t1 = time.perf_counter()
        for step in range(1, O):
            rows = decode([(nxt[s], I + step - 1, s, True) for s in range(B)])
            nxt = argmax_rows(rows)
        t2 = time.perf_counter()
        if it >= a.num_iters_warmup:
            lat.append(t2 - t0)
            first.append(t1 - t0)
            dec.append(t2 - t1)
    mean = lambda v: sum(v) / len(v)
    print(json.dumps({
        "system": "llama.cpp",
        "version": getattr(llama_cpp, "__version__", "?"),
        "batch_size": B, "input_len": I, "output_len": O, "threads": a.threads,
        "avg_latency_s": mean(lat),
        "prefill_tokens_per_s": B * I / mean(first),
        "decode_tokens_per_s": B * (O - 1) / mean(dec),
    }))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main()
