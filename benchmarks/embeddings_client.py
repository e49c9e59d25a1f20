"""Embeds one fixed corpus through an OpenAI-compatible `/v1/embeddings`
server and times it; saves the vectors for a cross-check.

Usage: python3 embeddings_client.py BASE_URL LABEL OUT_DIR [--inputs N] [--batch B] [--concurrency C]

The corpus: N seeded pseudo-sentences of 40-120 words. Timed: every input
sent in requests of B inputs by C concurrent clients, after one warm-up
request. Prints one JSON line (inputs/s, prompt tokens/s, wall time) and
writes OUT_DIR/LABEL.json with the vectors (float, in input order).
"""
import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were which are this be had not "
    "or have one all their there been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any my now such like our over man "
    "me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three paged attention block cache kernel memory"
).split()


def corpus(n, seed=7):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))).capitalize() + "." for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("label")
    ap.add_argument("out")
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    texts = corpus(a.inputs)
    client.embeddings.create(model=model, input=texts[: a.batch], encoding_format="float")  # warm-up
    batches = [texts[i : i + a.batch] for i in range(0, len(texts), a.batch)]

    def send(batch):
        r = client.embeddings.create(model=model, input=batch, encoding_format="float")
        return [d.embedding for d in sorted(r.data, key=lambda d: d.index)], r.usage.prompt_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        results = list(pool.map(send, batches))
    wall = time.perf_counter() - started
    vectors = [v for vs, _ in results for v in vs]
    tokens = sum(t for _, t in results)
    with open(f"{a.out}/{a.label}.json", "w") as f:
        json.dump(vectors, f)
    print(json.dumps({
        "label": a.label, "inputs": len(vectors), "prompt_tokens": tokens, "batch": a.batch,
        "concurrency": a.concurrency, "wall_s": round(wall, 3), "inputs_per_s": round(len(vectors) / wall, 1),
        "prompt_tokens_per_s": round(tokens / wall, 1), "dim": len(vectors[0]),
    }))


if __name__ == "__main__":
    main()
