"""Compares two `vellum generate --json` runs of the same prompts (one JSON
object a line): how many tokens agree before each prompt's first
difference, and the largest gap between the chosen tokens' logprobs there.

    python3 benchmarks/compare_generate.py LABEL A.jsonl B.jsonl
"""
import json
import sys


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    label, paths = sys.argv[1], sys.argv[2:]
    try:
        a_runs, b_runs = ([json.loads(l) for l in open(p) if l.strip()] for p in paths)
    except (OSError, ValueError) as err:
        sys.exit(f"generate, {label}: no comparison ({err})")
    same = total = 0
    worst = 0.0
    for a, b in zip(a_runs, b_runs):
        ta, tb = a["outputs"][0]["token_ids"], b["outputs"][0]["token_ids"]
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        same += n
        total += max(len(ta), len(tb))
        la, lb = a["outputs"][0]["logprobs"], b["outputs"][0]["logprobs"]
        worst = max([worst] + [abs(x[0][1] - y[0][1]) for x, y in zip(la[:n], lb[:n])])
    print(f"generate, {label}: {len(a_runs)}/{len(b_runs)} prompts, {same}/{total} tokens identical before "
          f"the first difference, largest logprob gap there {worst:.2e}")


if __name__ == "__main__":
    main()
