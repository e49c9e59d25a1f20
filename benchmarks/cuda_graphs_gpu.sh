#!/usr/bin/env bash
# CUDA graphs for decode steps, checked and measured in one call on a GPU
# machine (no Rust, no network), with .gpu/ and .gpu-llama/ carried:
#
#   kernels/cuda/gpu_suite.sh stage && benchmarks/cuda_vs_llama_cpp.sh pack   # here
#   bash benchmarks/cuda_graphs_gpu.sh                                         # there
#
# 1. llama.cpp's CUDA build starts in the background (~4 min on 16 cores);
# 2. meanwhile, the GPU suite's graph, executor, conformance (the fused and
#    stacked ops included), cuBLAS, attention, norm, NCCL and device-sampling
#    tests, then greedy generation on a SmolLM2-shaped
#    random Q4_1 model with graphs and with --enforce-eager (tokens and
#    logprobs compared); seeded sampled generation with sampling on the
#    device and on the host (tokens compared), and decode at 256 sequences
#    greedy / sampled on the device / sampled on the host;
# 3. once llama.cpp is built: SmolLM2-shaped Q4_1 at 1/64/256 sequences,
#    graphs with and without --async-scheduling (VARIANTS) against
#    llama-batched-bench, alternated rounds; then `vellum serve` the same two
#    ways (SERVE_MODES; eager is a mode too) at 64 and 256 clients (and
#    where the engine loop's time went, from /metrics); then, if the time
#    allows (BUDGET_S), a Llama-3-8B-shaped Q8_0 with graphs, its KV cache
#    in bf16 and in FP8 (--kv-cache-dtype fp8: half the bytes a decode
#    step's attention reads). The suite's attention and conformance tests
#    run every KV type, FP8 included.
# Logs and rows under $OUT; the tables last.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.gpu/out}
mkdir -p "$out/logs"
t0=$SECONDS
budget=${BUDGET_S:-560}
. benchmarks/lib.sh  # stamp, fits, wait_up
# Seconds left of the budget (at least 30).
left() { local l=$((budget - (SECONDS - t0))); echo $((l < 30 ? 30 : l)); }

(bash benchmarks/cuda_vs_llama_cpp.sh build >"$out/logs/llama_build.txt" 2>&1; echo "build exit $?" >>"$out/logs/llama_build.txt") &
build=$!

export SUITE_FILTER=${SUITE_FILTER:-"decode_steps the_cuda_executor tensor_parallel_groups the_conformance_suite sixteen_bit paged_attention_matches rms_norm"}
SUITE_LIMIT=${SUITE_LIMIT:-200} bash .gpu/run.sh suite sampling >"$out/logs/suite.txt" 2>&1
stamp "suite exit $?"
grep -E "^test |test result|recorded|SKIPPED|panicked" "$out/logs/suite.txt" | cut -c1-220

# shellcheck disable=SC1091 # staged there
source .gpu/run.sh env >/dev/null
smol=/tmp/smollm2-135m-q4_1.gguf
.gpu/x/write_random_checkpoint --shape smollm2-135m --format gguf --dtype q4_1 --out "$smol" >/dev/null 2>&1

# Greedy generation, graphs against eager: 12 prompts of different lengths
# (random weights: every top-1 margin is small, so a difference in the last
# bits would show as a different token).
prompts=()
for i in $(seq 1 12); do
    p="prompt $i:"
    for j in $(seq 1 $((i * 7))); do p+=" word$j"; done
    prompts+=(--prompt "$p")
done
for mode in graphs eager; do
    flags=""
    [ "$mode" = eager ] && flags=--enforce-eager
    # shellcheck disable=SC2086
    timeout 120 .gpu/x/vellum generate --device cuda --model "$smol" "${prompts[@]}" --max-tokens 200 --logprobs 1 --json $flags \
        >"$out/logs/generate_$mode.jsonl" 2>"$out/logs/generate_$mode.log"
    stamp "generate ($mode) exit $?"
done
python3 benchmarks/compare_generate.py "graphs vs eager" "$out/logs/generate_graphs.jsonl" "$out/logs/generate_eager.jsonl"
grep -h "recorded a step as a CUDA graph" "$out/logs/generate_graphs.log" | tail -3 | cut -c1-220

# Sampling on the device against the host sampler: seeded generation
# (temperature 0.8, top-p 0.95, logprobs) gives the same tokens either way;
# then decode at 256 sequences greedy, sampled on the device, and sampled
# on the host (every row's logits copied over).
for mode in device host; do
    env=""
    [ "$mode" = host ] && env="VELLUM_DEVICE_SAMPLING=0"
    # shellcheck disable=SC2086
    env $env timeout 120 .gpu/x/vellum generate --device cuda --model "$smol" "${prompts[@]}" --max-tokens 100 --temperature 0.8 \
        --top-p 0.95 --seed 7 --logprobs 2 --json >"$out/logs/sampled_$mode.jsonl" 2>"$out/logs/sampled_$mode.log"
    stamp "sampled generate ($mode) exit $?"
done
python3 - "$out/logs/sampled_device.jsonl" "$out/logs/sampled_host.jsonl" <<'EOF'
import json, sys
d, h = ([json.loads(l) for l in open(p) if l.strip()] for p in sys.argv[1:])
same = sum(a["outputs"][0]["token_ids"] == b["outputs"][0]["token_ids"] for a, b in zip(d, h))
print(f"sampled generate, device vs host sampling: {same}/{len(d)} prompts with identical tokens")
EOF
for mode in greedy device host; do
    env="" flags="--temperature 0.8 --top-p 0.95"
    [ "$mode" = greedy ] && flags=""
    [ "$mode" = host ] && env="VELLUM_DEVICE_SAMPLING=0"
    # shellcheck disable=SC2086
    # 32 tokens out: the host's top-p over 256 flat rows of random weights
    # takes ~1 s a step (128 steps did not finish in 120 s).
    env $env timeout 120 .gpu/x/vellum bench latency --device cuda --model "$smol" --batch-size 256 --input-len 128 --output-len 32 \
        --num-iters 1 --json $flags 2>"$out/logs/decode256_$mode.log" >"$out/logs/decode256_$mode.json"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('decode at 256 (32 out), $mode:', round(d['decode_tokens_per_s']), 'tok/s')" \
        "$out/logs/decode256_$mode.json" || echo "decode at 256, $mode: no result (see logs/decode256_$mode.log)"
done

wait "$build"
stamp "$(tail -1 "$out/logs/llama_build.txt")"
VARIANTS=${VARIANTS:-"graphs:;async:--async-scheduling"} ROUNDS=${ROUNDS:-2} timeout "$(left)" \
    bash benchmarks/cuda_vs_llama_cpp.sh run "$smol" smollm2-135m-q4_1 >"$out/logs/smol_table.txt" 2>"$out/logs/smol_run.txt"
stamp "smollm2 exit $?"
# Serving: `vellum serve` with graphs (recorded at start) and eager, under
# `vellum bench serve` at 64 and 256 clients; where the engine loop's time
# went, from /metrics.
serve() { # label model mode clients...
    local label=$1 model=$2 mode=$3
    shift 3
    local flags=""
    [ "$mode" = eager ] && flags=--enforce-eager
    [ "$mode" = async ] && flags=--async-scheduling
    # shellcheck disable=SC2086
    .gpu/x/vellum serve --device cuda --model "$model" --port 8011 --max-num-seqs 256 $flags >"$out/logs/serve_${label}_$mode.log" 2>&1 &
    local pid=$!
    wait_up http://127.0.0.1:8011 60
    for c in "$@"; do
        .gpu/x/vellum bench serve --base-url http://127.0.0.1:8011 --model "$model" --input-len 128 --output-len 128 \
            --num-prompts $((c * 4)) --max-concurrency "$c" --label "$label-$mode-$c" --json \
            >"$out/logs/serve_${label}_${mode}_$c.json" 2>>"$out/logs/serve_${label}_$mode.log"
        python3 - "$out/logs/serve_${label}_${mode}_$c.json" "$label $mode $c" <<'EOF' >>"$out/logs/serve_table.txt"
import json, sys, urllib.request
v = json.load(open(sys.argv[1]))
m = {l.split("{")[0]: float(l.split()[-1]) for l in urllib.request.urlopen("http://127.0.0.1:8011/metrics").read().decode().splitlines()
     if l.startswith("vellum:engine_") and "seconds_total" in l}
busy = {k.split("engine_")[1].replace("_seconds_total", ""): round(v2, 2) for k, v2 in m.items()}
steps = {l.split("{")[0].split()[0]: float(l.split()[-1]) for l in urllib.request.urlopen("http://127.0.0.1:8011/metrics").read().decode().splitlines()
         if l.startswith("vellum:engine_") and "steps_total" in l}
busy["steps"] = int(sum(v2 for k, v2 in steps.items() if "decode" not in k))
busy["decode_steps"] = int(sum(v2 for k, v2 in steps.items() if "decode" in k))
print(f"| {sys.argv[2]} | {v['output_throughput']:,.0f} | {v['ttft_s']['median'] * 1e3:.0f} / {v['ttft_s']['p99'] * 1e3:.0f} | {v['failed']} | {busy} |")
EOF
    done
    kill "$pid"
    wait "$pid" 2>/dev/null
}
echo "| model mode clients | output tok/s | TTFT median / p99 (ms) | failed | engine seconds so far |" >"$out/logs/serve_table.txt"
for mode in ${SERVE_MODES:-graphs async graphs async}; do serve smollm2 "$smol" "$mode" 64 256; done
stamp "serving done"
if [ $((SECONDS - t0)) -lt $((budget - 140)) ]; then
    bash benchmarks/cuda_vs_llama_cpp.sh model llama3-8b-q8_0 /tmp/m8.gguf >/dev/null 2>&1
    VARIANTS="graphs:;fp8:--kv-cache-dtype fp8" ROUNDS=1 timeout "$(left)" \
        bash benchmarks/cuda_vs_llama_cpp.sh run /tmp/m8.gguf llama3-8b-q8_0 >"$out/logs/m8_table.txt" 2>"$out/logs/m8_run.txt"
    stamp "8b exit $?"
fi
grep -h "recorded a step as a CUDA graph" "$out"/logs/graphs_smollm2*_256_1.log 2>/dev/null | tail -2 | cut -c1-220
grep -h "profile run" "$out"/logs/graphs_*_1.log 2>/dev/null | tail -2 | cut -c1-260
cat "$out/logs/smol_table.txt" "$out/logs/m8_table.txt" "$out/logs/serve_table.txt" 2>/dev/null
