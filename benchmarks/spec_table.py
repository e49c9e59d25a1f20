#!/usr/bin/env python3
"""The speculative-decoding table from `vellum bench latency --json` lines,
each tagged with its workload, mode (plain, ngram, draft_model,
llama-lookup) and round; medians over the rounds.

    python3 benchmarks/spec_table.py RUNS.jsonl            # benchmarks/spec_decode.sh's table
    python3 benchmarks/spec_table.py --by-method RUNS.jsonl

The first form is the CPU script's table: a row per workload, n-gram
against plain, llama.cpp's `llama-lookup` beside them ("-" where it did not
run). `--by-method` (benchmarks/golden_gpu.sh's --device cuda step) has a
row per workload and speculative method that ran, each against the same
workload's plain runs, with how many runs of each the medians are over; a
method or workload whose runs all failed shows "-". Standard library only.
"""
import json
import statistics
import sys

WORKLOADS = ['rewrite_text', 'rewrite_code', 'fix_code', 'chat']
LOOKUP = 'llama-lookup'


def values(runs, w, m, key='decode_tokens_per_s'):
    return [r[key] for r in runs if r['workload'] == w and r['mode'] == m]


def med(runs, w, m, key='decode_tokens_per_s'):
    v = values(runs, w, m, key)
    return statistics.median(v) if v else None


def spec_medians(runs, w, m):
    """Median acceptance rate and tokens per verification of the runs that drafted."""
    sd = [r['spec_decode'] for r in runs if r['workload'] == w and r['mode'] == m and r.get('spec_decode')]
    acc = statistics.median(x['acceptance_rate'] for x in sd) if sd else 0.0
    mlen = statistics.median(x['mean_acceptance_length'] for x in sd) if sd else 0.0
    return acc, mlen


def cpu_table(runs):
    print(f"{'workload':14} {'plain tok/s':>11} {'ngram tok/s':>11} {'speed-up':>8} {'accepted':>8} {'mean len':>8} {'llama-lookup':>12} {'its accept':>10}")
    for w in WORKLOADS:
        p, s = med(runs, w, 'plain'), med(runs, w, 'ngram')
        acc, mlen = spec_medians(runs, w, 'ngram')
        l, la = med(runs, w, LOOKUP), med(runs, w, LOOKUP, 'acceptance_rate')
        ls = f"{l:12.1f} {100 * la:9.1f}%" if l else f"{'-':>12} {'-':>10}"
        print(f"{w:14} {p:11.1f} {s:11.1f} {s / p:7.2f}× {100 * acc:7.1f}% {mlen:8.2f} {ls}")


def by_method(runs):
    methods = [m for m in dict.fromkeys(r['mode'] for r in runs) if m not in ('plain', LOOKUP)]
    print(f"{'workload':14} {'method':12} {'runs':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} {'accepted':>8} {'mean len':>8}")
    for w in WORKLOADS:
        p = med(runs, w, 'plain')
        for m in methods or ['ngram']:
            if m != 'ngram' and not any(r['workload'] == w and r['mode'] == m for r in runs):
                continue
            s = med(runs, w, m)
            acc, mlen = spec_medians(runs, w, m)
            n = f"{len(values(runs, w, 'plain'))}+{len(values(runs, w, m))}"
            ps = f"{p:11.1f}" if p else f"{'-':>11}"
            ss = f"{s:10.1f}" if s else f"{'-':>10}"
            up = f"{s / p:7.2f}×" if p and s else f"{'-':>8}"
            sd = f"{100 * acc:7.1f}% {mlen:8.2f}" if s else f"{'-':>8} {'-':>8}"
            print(f"{w:14} {m:12} {n:>4} {ps} {ss} {up} {sd}")


def main():
    args = sys.argv[1:]
    grouped = '--by-method' in args
    paths = [a for a in args if a != '--by-method']
    if len(paths) != 1:
        sys.exit(__doc__)
    with open(paths[0]) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    (by_method if grouped else cpu_table)(runs)


if __name__ == '__main__':
    main()
