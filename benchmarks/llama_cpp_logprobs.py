#!/usr/bin/env python3
"""llama.cpp's own logprob gap against the float64 golden references.

The CPU-speed issue's accuracy rule for paths that quantize activations: their
largest logprob gap on the golden prompts must not exceed llama.cpp's own on
the same file and prompts. This measures llama.cpp's: it starts `llama-server`
(built by benchmarks/llama_cpp.sh) on the model file, asks `/completion` for
16 greedy tokens with the top-5 logprobs of each step for every golden prompt
(as token ids), and walks the positions as tests/golden.rs does: where both
pick the same token, |logprob - reference| counts; at the first disagreement
each side's token must be in the other's top-5 and the prompt stops there.

    python3 benchmarks/llama_cpp_logprobs.py BIN_DIR MODEL.gguf GOLDEN.json [THREADS]
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main():
    bin_dir, model, golden_path = sys.argv[1:4]
    threads = sys.argv[4] if len(sys.argv) > 4 else "2"
    golden = json.load(open(golden_path))
    port = free_port()
    server = subprocess.Popen(
        [f"{bin_dir}/llama-server", "-m", model, "--port", str(port), "-t", threads, "-c", "4096", "-np", "1", "--no-webui"]
        + os.environ.get("LLAMA_EXTRA", "").split(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.2)
        worst, rows, gaps = 0.0, [], []
        for i, case in enumerate(golden):
            out = post(base + "/completion", {
                "prompt": case["prompt_ids"], "n_predict": len(case["greedy_ids"]), "temperature": 0.0,
                "n_probs": 5, "cache_prompt": False, "samplers": ["top_k"], "top_k": 1,
            })
            probs = out["completion_probabilities"]
            agreed, gap = 0, 0.0
            for j, (step, ref_id, ref_top) in enumerate(zip(probs, case["greedy_ids"], case["top_logprobs"])):
                tok = step["id"]
                if tok == ref_id:
                    gap = max(gap, abs(step["logprob"] - ref_top[0][1]))
                    gaps.append((j, abs(step["logprob"] - ref_top[0][1])))
                    agreed += 1
                else:
                    ours_top = [t["id"] for t in step["top_logprobs"]]
                    in_ref = any(t[0] == tok for t in ref_top)
                    print(f"prompt {i}: first disagreement at step {j}: llama.cpp {tok} (in reference top-5: {in_ref}), "
                          f"reference {ref_id} (in llama.cpp top-5: {ref_id in ours_top})")
                    break
            worst = max(worst, gap)
            rows.append((i, agreed, len(case["greedy_ids"]), gap))
        for i, agreed, n, gap in rows:
            print(f"prompt {i}: {agreed}/{n} tokens agree, largest gap {gap:.4f} nats")
        print(f"{model}: llama.cpp's largest logprob gap on agreeing tokens: {worst:.4f} nats "
              f"(mean {sum(g for _, g in gaps) / max(len(gaps), 1):.4f} over {len(gaps)} tokens; "
              f"first 5 of each prompt: mean {sum(g for j, g in gaps if j < 5) / max(sum(1 for j, _ in gaps if j < 5), 1):.4f})")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
