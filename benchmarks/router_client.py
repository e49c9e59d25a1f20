"""A shared-prefix chat workload through a router, and what it did to the
replicas' prefix caches.

Usage: python3 router_client.py ROUTER_URL LABEL REPLICA_URL [REPLICA_URL ...]
       [--requests N] [--concurrency C] [--prefixes P] [--model NAME]

Many users, a few long system prompts: request i uses system prompt
`i mod P` (seeded order) and a short question of its own, streamed, 8 output
tokens. Prints one JSON line: the prefix-cache hit rate summed over the
replicas (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`,
the run's increments), the hit rate per replica, and the client's time to
first token (median, p90) and wall time.
"""
import argparse
import json
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

TOPICS = ["a travel agency in Lisbon", "a tax office in Ohio", "a bicycle repair shop", "a hospital's pharmacy",
          "a university library", "a cloud hosting company", "a bakery chain", "a public transit authority"]


def system_prompt(k):
    rng = random.Random(1000 + k)
    rules = " ".join(f"Rule {j}: {rng.choice(['always', 'never', 'politely', 'briefly'])} "
                     f"{rng.choice(['answer', 'refuse', 'explain', 'confirm', 'summarize'])} questions about "
                     f"{rng.choice(['prices', 'hours', 'refunds', 'locations', 'staff', 'policies'])}." for j in range(40))
    return f"You are the assistant of {TOPICS[k % len(TOPICS)]}. {rules}"


def scrape(url):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            out["hits"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total"):
            out["queries"] += float(line.rsplit(" ", 1)[1])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("router")
    ap.add_argument("label")
    ap.add_argument("replicas", nargs="+")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.router + "/v1", api_key="none", max_retries=0, timeout=600)
    rng = random.Random(7)
    order = [rng.randrange(a.prefixes) for _ in range(a.requests)]
    before = [scrape(r) for r in a.replicas]

    def one(i):
        messages = [{"role": "system", "content": system_prompt(order[i])},
                    {"role": "user", "content": f"Question {i}: what are your hours on day {rng.randrange(1, 29)}?"}]
        started = time.perf_counter()
        first = None
        stream = client.chat.completions.create(model=a.model, messages=messages, max_tokens=8, temperature=0, stream=True)
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
        return first if first is not None else time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        ttft = sorted(pool.map(one, range(a.requests)))
    wall = time.perf_counter() - started
    after = [scrape(r) for r in a.replicas]
    per = [{"hits": x["hits"] - b["hits"], "queries": x["queries"] - b["queries"]} for x, b in zip(after, before)]
    hits, queries = sum(p["hits"] for p in per), sum(p["queries"] for p in per)
    print(json.dumps({
        "label": a.label, "requests": a.requests, "prefixes": a.prefixes, "concurrency": a.concurrency,
        "hit_rate": round(hits / max(queries, 1), 4),
        "hit_rate_per_replica": [round(p["hits"] / max(p["queries"], 1), 4) for p in per],
        "queries_per_replica": [int(p["queries"]) for p in per],
        "ttft_median_s": round(statistics.median(ttft), 3), "ttft_p90_s": round(ttft[int(0.9 * (len(ttft) - 1))], 3),
        "wall_s": round(wall, 2),
    }))


if __name__ == "__main__":
    main()
