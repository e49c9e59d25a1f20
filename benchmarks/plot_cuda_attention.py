#!/usr/bin/env python3
"""Draws docs/figures/cuda-attention-bandwidth.svg from the paged-attention
bandwidth runs (examples/attention_bench.rs, rows in benchmarks/results/):
KV bytes read per second against the batch, per context length, for the
kernel before (a thread block per query head) and after (a GQA group per
thread block, block ids fetched 32 at a time), with the device's own copy
bandwidth as the ceiling.

    python3 benchmarks/plot_cuda_attention.py   # needs matplotlib
"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = [
    ("a thread block per head", ROOT / "benchmarks/results/2026-11-26-h200-attention-per-head.jsonl", "--"),
    ("a GQA group per thread block", ROOT / "benchmarks/results/2026-11-26-h200-attention-grouped.jsonl", "-"),
]


def load(path):
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    copy = next(r["copy_gbps"] for r in rows if "copy_gbps" in r)
    return [r for r in rows if "shape" in r], copy


fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
for ax, shape in zip(axes, ["llama3-8b", "smollm2-135m"]):
    copy = None
    for label, path, style in RUNS:
        rows, copy = load(path)
        for ctx, color in [(1024, "tab:blue"), (4096, "tab:green"), (16384, "tab:red")]:
            pts = sorted((r["batch"], r["kv_bytes"] / (r["shuffled_ms"] * 1e6)) for r in rows if r["shape"] == shape and r["context"] == ctx)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o", ms=3,
                    label=f"{ctx} tokens, {label}")
    ax.axhline(copy, color="gray", lw=1)
    ax.text(1, copy * 0.96, f"device-to-device copy {copy:.0f} GB/s", va="top", fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences in the decode batch")
    ax.set_title(f"{shape} shape, f16 KV cache, shuffled blocks", fontsize=10)
    ax.grid(alpha=0.3)
axes[0].set_ylabel("KV bytes read per second (GB/s)")
axes[1].legend(fontsize=7, loc="upper left")
fig.suptitle("Paged-attention decode on an NVIDIA H200 (vellum attention_bench, 2026-11-26)", fontsize=11)
fig.tight_layout()
out = ROOT / "docs/figures/cuda-attention-bandwidth.svg"
fig.savefig(out, metadata={"Date": None})
print(out)
