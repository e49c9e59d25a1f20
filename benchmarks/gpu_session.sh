#!/usr/bin/env bash
# What a session lent a GPU runs first, in one call (no Rust, no network
# there). A session has 15 minutes of device time, the machine's start
# (a minute or more) included, so the plan is two calls back to back:
#
#   kernels/cuda/gpu_suite.sh stage && benchmarks/cuda_vs_llama_cpp.sh pack \
#       && bash benchmarks/golden_gpu.sh split                  # here
#   bash benchmarks/gpu_session.sh    # there, carrying .gpu, .gpu-llama and
#                                     # .gpu-golden/a (~62 MB; BUDGET_S,
#                                     # default 450)
#   bash benchmarks/golden_gpu.sh run # there, at once, carrying
#                                     # .gpu-golden/b (BUDGET_S, default 180)
#
# This script first keeps .gpu-golden/a in /tmp for the second call (the
# default model is 98 MB; a call carries 64 MiB), then, in order of
# priority, each step only if the budget leaves it room:
# 0. llama.cpp's CUDA build starts in the background (~4 min on 16 cores);
# 1. the GPU suite's tests of what no GPU has run yet: the conformance suite
#    (the q/k/v split writing the KV cache, linears with and without bf16
#    weight copies, attention with flash prefill), paged attention against
#    float64 (flash prefill and every paged-load variant among the
#    kernels), the graph test (mixed steps replayed), the GEMV test (plan
#    4:2:1 among others), the tensor-core GEMM test (the staged kernel bit
#    for bit against the one before it), the executor against the CPU; then
#    the staged GEMM's milliseconds at 3-128 rows against that kernel and
#    cuBLAS on bf16 copies (gemm_bench --staged); then flash
#    prefill's TFLOP/s (attention_bench --prefill --quick) and the paged
#    decode kernels' loads side by side (attention_bench --loads: tiled
#    values and prefetch against the kernel before them, GB/s); then
#    sampling on the device against the host sampler, and 256 top-p rows
#    of Gemma 3's vocabulary drawn from the score bins against the radix
#    descents and greedy (tests/device_sampling.rs);
# 2. a Llama-3-8B-shaped Q8_0 (written there): two prompts of 4,096 tokens
#    with flash prefill and without (VELLUM_FLASH_ATTENTION=0), and
#    single-stream decode of it and of a SmolLM2-shaped Q4_1 with the fused
#    GEMV and without (VELLUM_FUSED_GEMV=0, one round), and its decode at
#    64 sequences through the staged GEMM on the Q8_0 blocks
#    (VELLUM_COPIES_FROM_ROWS=128), while llama.cpp
#    builds; then `bench latency` at 1 / 64 / 256 sequences (bf16 weight
#    copies, the default) against llama.cpp's `llama-batched-bench` on the
#    same file (the tensor-core issue's rows), one round;
# 3. benchmarks/mixed_graphs_gpu.sh's generate and serving steps with the
#    rest (the step-overhead issue's mixed steps and its 8B p99 ITL).
# A step the suite failed is turned off for the steps after it.
# $OUT: session.txt (this script's lines), mixed_summary.txt,
# mixed_logs.tgz, logs.tgz (everything else).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.gpu/out}
mkdir -p "$out/logs"
t0=$SECONDS
budget=${BUDGET_S:-450}
exec > >(tee "$out/session.txt") 2>&1
. benchmarks/lib.sh  # stamp, fits, wait_up
left() { echo $((budget - (SECONDS - t0))); }
checkpoint() { tar -C "$out" -czf "$out/logs.tgz" logs 2>/dev/null; }

# The default model's first part, for golden_gpu.sh run in the next call.
[ -f .gpu-golden/a ] && cp .gpu-golden/a /tmp/vellum-golden.a && stamp "golden part a kept in /tmp"

build=""
if [ -f .gpu-llama/llama.cpp.tar.xz ]; then
    (bash benchmarks/cuda_vs_llama_cpp.sh build >"$out/logs/llama_build.txt" 2>&1; echo "build exit $?" >>"$out/logs/llama_build.txt") &
    build=$!
fi

SUITE_FILTER="the_conformance_suite paged_attention_matches decode_steps gemv_and_cuda_core tensor_core_gemm the_cuda_executor" SUITE_LIMIT=200 \
    bash .gpu/run.sh suite >"$out/logs/suite.txt" 2>&1
stamp "suite exit $?"
grep -E "^test |test result|recorded|SKIPPED|panicked|Flash" "$out/logs/suite.txt" | cut -c1-240
# A new path the suite failed is turned off for the measurements after it
# (each is still compared on and off where its own step does that).
# (gpu.rs's check_attention names the kernel first: "Flash: max |err| …",
# "V1 with Plain loads: …".)
if grep -A3 "panicked" "$out/logs/suite.txt" | grep -qE "Flash"; then
    export VELLUM_FLASH_ATTENTION=0
    stamp "flash prefill failed the suite: VELLUM_FLASH_ATTENTION=0 from here"
fi
if grep -A3 "panicked" "$out/logs/suite.txt" | grep -qE "(^|failed: )V[12]( with [A-Za-z]+ loads)?: "; then
    export VELLUM_PAGED_LOADS=plain
    stamp "the paged decode kernels failed the suite: VELLUM_PAGED_LOADS=plain from here"
fi
if grep -A3 "panicked" "$out/logs/suite.txt" | grep -qE "norm_linear|linear_add"; then
    export VELLUM_FUSED_GEMV=0
    stamp "the fused GEMV failed the suite: VELLUM_FUSED_GEMV=0 from here"
fi
if grep -A3 "panicked" "$out/logs/suite.txt" | grep -qE "gemm_mma_staged"; then
    export VELLUM_GEMM_MMA=registers
    stamp "the staged GEMM failed the suite: VELLUM_GEMM_MMA=registers from here"
fi
# The staged GEMM against the kernel before it and cuBLAS on bf16 copies.
OUT="$out/logs" GEMM_ARGS=--staged GEMM_LIMIT=60 bash .gpu/run.sh gemm >"$out/logs/gemm_staged.txt" 2>&1
stamp "gemm staged exit $?"
grep -E "^\|" "$out/logs/gemm_staged.txt"
OUT="$out/logs" PREFILL_LIMIT=60 bash .gpu/run.sh prefill >"$out/logs/prefill.txt" 2>&1
stamp "prefill exit $?"
grep -E "^\|" "$out/logs/prefill.txt"
OUT="$out/logs" LOADS_LIMIT=60 bash .gpu/run.sh loads >"$out/logs/loads.txt" 2>&1
stamp "paged loads exit $?"
grep -E "^\|" "$out/logs/loads.txt"
# Sampling on the device against the host sampler, then 256 top-p rows of
# 262,144 drawn from the score bins, by the descents and greedily (ms).
SAMPLING_LIMIT=90 bash .gpu/run.sh sampling >"$out/logs/sampling.txt" 2>&1
rc=$?
stamp "sampling exit $rc"
grep -E "rows of|test result|panicked" "$out/logs/sampling.txt" | cut -c1-240
if [ "$rc" != 0 ]; then
    export VELLUM_SAMPLE_BINNED=0
    stamp "device sampling failed: VELLUM_SAMPLE_BINNED=0 from here"
fi
checkpoint

# shellcheck disable=SC1091 # staged there
source .gpu/run.sh env >/dev/null
m8=/tmp/m8.gguf
if [ "$(left)" -gt 240 ]; then
    timeout 120 bash benchmarks/cuda_vs_llama_cpp.sh model llama3-8b-q8_0 "$m8" >/dev/null 2>&1
    stamp "8b written, exit $?"
    # Flash prefill end to end: 2 × 4,096 prompt tokens in one step.
    for flash in 1 0; do
        VELLUM_FLASH_ATTENTION=$flash timeout 60 .gpu/x/vellum bench latency --device cuda --model "$m8" --input-len 4096 \
            --output-len 2 --batch-size 2 --num-iters 2 --json >"$out/logs/m8_prefill_flash$flash.json" 2>"$out/logs/m8_prefill_flash$flash.log"
        stamp "8b prefill 2x4096, flash=$flash: exit $? $(cut -c1-300 "$out/logs/m8_prefill_flash$flash.json")"
    done
    # The fused GEMV (6 launches a layer at one row, against 9): one sequence.
    s135=/tmp/smollm2-135m-q4_1.gguf
    timeout 60 bash benchmarks/cuda_vs_llama_cpp.sh model smollm2-135m-q4_1 "$s135" >/dev/null 2>&1
    for fused in 1 0; do
        for m in "$s135" "$m8"; do
            tag=$(basename "$m" .gguf)_fused$fused
            VELLUM_FUSED_GEMV=$fused timeout 45 .gpu/x/vellum bench latency --device cuda --model "$m" --input-len 128 \
                --output-len 128 --batch-size 1 --num-iters 2 --json >"$out/logs/single_$tag.json" 2>"$out/logs/single_$tag.log"
            stamp "single stream $tag: exit $? $(cut -c1-300 "$out/logs/single_$tag.json")"
        done
    done
    # Decode at 64 rows through the staged GEMM on the Q8_0 blocks, the
    # bf16 copies kept for products of 128 rows and more (the prompts); the
    # table's 64 row below takes cuBLAS on the copies.
    VELLUM_COPIES_FROM_ROWS=128 timeout 60 .gpu/x/vellum bench latency --device cuda --model "$m8" --input-len 128 \
        --output-len 128 --batch-size 64 --num-iters 2 \
        --json >"$out/logs/m8_b64_staged.json" 2>"$out/logs/m8_b64_staged.log"
    stamp "8b decode 64 rows, staged GEMM below 128 rows: exit $? $(cut -c1-300 "$out/logs/m8_b64_staged.json")"
    checkpoint
    if [ -n "$build" ]; then
        # llama.cpp's row needs its build; give it until 30 s before the end.
        timeout $(($(left) - 200 > 0 ? $(left) - 200 : 1)) tail --pid="$build" -f /dev/null
        stamp "$(tail -1 "$out/logs/llama_build.txt" 2>/dev/null)"
    fi
    VARIANTS="copies:" ROUNDS=1 timeout $(($(left) - 60)) \
        bash benchmarks/cuda_vs_llama_cpp.sh run "$m8" llama3-8b-q8_0 >"$out/logs/m8_table.txt" 2>"$out/logs/m8_run.txt"
    stamp "8b exit $?"
    cat "$out/logs/m8_table.txt"
    grep -h "backend=" "$out"/logs/*copies*.log 2>/dev/null | head -1 | cut -c1-260
    checkpoint
fi

if [ "$(left)" -gt 60 ]; then
    SKIP_SUITE=1 BUDGET_S=$(left) bash benchmarks/mixed_graphs_gpu.sh >/dev/null 2>&1
    stamp "mixed graphs done"
    cat "$out/mixed_summary.txt"
fi
[ -n "$build" ] && kill "$build" 2>/dev/null
checkpoint
stamp "done"
exec >&- 2>&-
