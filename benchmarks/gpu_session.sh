#!/usr/bin/env bash
# What a session lent a GPU runs first, in one call (no Rust, no network
# there), with .gpu/ carried:
#
#   kernels/cuda/gpu_suite.sh stage       # here (check .gpu matches HEAD)
#   bash benchmarks/gpu_session.sh        # there (BUDGET_S, default 540)
#
# 1. benchmarks/mixed_graphs_gpu.sh within 250 s: CUDA graphs for mixed
#    steps checked against eager launches and measured under `vellum serve`
#    (the step-overhead issue);
# 2. benchmarks/gemv_plans_gpu.sh with the rest, on plans 2:2:1 and 4:2:1:
#    4:2:1's correctness test and its single-stream speed (the tensor-core
#    issue's decode GEMV), the device sampler, serving counters.
# Then, in two more calls back to back, benchmarks/golden_gpu.sh stash and
# run (the golden prompts through --device cuda, the NCCL group of one, and
# speculative decoding through --device cuda).
# $OUT: mixed_summary.txt, mixed_logs.tgz, summary.txt, gemv.jsonl, logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
budget=${BUDGET_S:-540}
BUDGET_S=250 bash benchmarks/mixed_graphs_gpu.sh
left=$((budget - (SECONDS - t0)))
echo "[$((SECONDS - t0)) s] mixed graphs done; ${left} s left for the GEMV plans"
[ "$left" -gt 60 ] && PLANS=${PLANS:-2:2:1,4:2:1} BUDGET_S=$left bash benchmarks/gemv_plans_gpu.sh
cat "${OUT:-.gpu/out}/mixed_summary.txt"
