#!/usr/bin/env python3
"""Walks `vellum generate --json --logprobs 5` output against a float64
reference file as tests/golden.rs does: where both pick the same token its
logprob gap counts; a prompt stops at its first disagreement. Prints the
tokens that agree, the largest and the mean gap.

    python3 golden_walk.py REFERENCE.json VELLUM_OUTPUT.jsonl
"""
import json, sys
ref = json.load(open(sys.argv[1]))
outs = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
agreed_total, gaps, worst = 0, [], 0.0
for c, o in zip(ref, outs):
    assert o["prompt_token_ids"] == c["prompt_ids"], (o["prompt_token_ids"][:8], c["prompt_ids"][:8])
    out = o["outputs"][0]
    agreed = 0
    for j, (t, r) in enumerate(zip(out["token_ids"], c["greedy_ids"])):
        if t == r:
            lp = dict((a, b) for a, b in out["logprobs"][j])[t]
            g = abs(lp - c["top_logprobs"][j][0][1]); gaps.append(g); worst = max(worst, g); agreed += 1
        else:
            break
    agreed_total += agreed
n = sum(len(c["greedy_ids"]) for c in ref)
print(f"{agreed_total}/{n} agree, largest {worst:.4f}, mean {sum(gaps)/max(len(gaps),1):.4f}")
