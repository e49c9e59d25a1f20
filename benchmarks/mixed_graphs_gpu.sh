#!/usr/bin/env bash
# CUDA graphs for mixed steps (`--compilation-config '{"cudagraph_mode":
# "FULL"}'`), checked and measured in one call on a GPU machine (no Rust, no
# network), with .gpu/ carried:
#
#   kernels/cuda/gpu_suite.sh stage          # here
#   bash benchmarks/mixed_graphs_gpu.sh      # there (BUDGET_S, default 300)
#
# 1. the GPU suite's graph test: decode steps and mixed steps (two decodes
#    beside a prompt chunk, sampling or not) replayed against eager
#    launches;
# 2. greedy `generate` on a SmolLM2-shaped random Q4_1 with mixed steps on
#    purpose (12 prompts, at most 4 sequences, 64 tokens a step: prompt
#    chunks beside decodes), FULL against --enforce-eager: tokens and
#    logprobs compared, the mixed graphs recorded counted from the log;
# 3. `vellum serve` on that model at 256 clients (128 in / 128 out), the
#    default (FULL_DECODE_ONLY) and FULL with capture sizes up to 1,024
#    tokens, alternated twice: output tok/s, ITL, and from /metrics the
#    executor's time a uniform decode step and a mixed one; `bench latency`
#    at 256 sequences beside it (the step-overhead issue's ≥ 95% row), and
#    `bench throughput` on the same requests offline (prefill included: what
#    serving can reach);
# 4. if the budget allows, a Llama-3-8B-shaped Q8_0 served at 64 clients the
#    same two ways: ITL median and p99 (the issue's p99 ≤ 3× median row).
# $OUT gets mixed_summary.txt as it runs and mixed_logs.tgz after every step.
# CLIENTS and PROMPTS (default 256 and 1,024) shrink step 3 for a smoke run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.gpu/out}
logs=$(mktemp -d)
t0=$SECONDS
budget=${BUDGET_S:-300}
mkdir -p "$out"
exec > >(tee "$out/mixed_summary.txt") 2>&1
. benchmarks/lib.sh  # stamp, fits, wait_up
checkpoint() { tar -C "$logs" -czf "$out/mixed_logs.tgz" . 2>/dev/null; }
# shellcheck disable=SC1091 # staged there
source .gpu/run.sh env >/dev/null
full='{"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 1024}'

# SKIP_SUITE=1: the caller ran the graph test (benchmarks/gpu_session.sh).
if [ -z "${SKIP_SUITE:-}" ]; then
    timeout 120 .gpu/x/gpu_suite --test-threads 1 --nocapture decode_steps_replayed_as_cuda_graphs >"$logs/suite_graphs.txt" 2>&1
    stamp "graph test exit $?"
    grep -E "recorded|test result|panicked|SKIPPED" "$logs/suite_graphs.txt" | cut -c1-300
    checkpoint
fi

smol=/tmp/smollm2-135m-q4_1.gguf
timeout 60 .gpu/x/write_random_checkpoint --shape smollm2-135m --format gguf --dtype q4_1 --out "$smol" >/dev/null 2>&1
prompts=()
for i in $(seq 1 12); do
    p="prompt $i:"
    for j in $(seq 1 $((i * 9))); do p+=" word$j"; done
    prompts+=(--prompt "$p")
done
for mode in full eager; do
    fits 60 || break
    flags=(--compilation-config "$full")
    [ "$mode" = eager ] && flags=(--enforce-eager)
    RUST_LOG=vellum_backend_cuda=info timeout 60 .gpu/x/vellum generate --device cuda --model "$smol" "${prompts[@]}" \
        --max-tokens 120 --logprobs 1 --json --max-num-seqs 4 --max-num-batched-tokens 64 "${flags[@]}" \
        >"$logs/generate_$mode.jsonl" 2>"$logs/generate_$mode.log"
    stamp "generate ($mode) exit $?; mixed graphs recorded: $(grep -c 'mixed=true' "$logs/generate_$mode.log")"
done
python3 benchmarks/compare_generate.py "with mixed steps, FULL vs eager" "$logs/generate_full.jsonl" "$logs/generate_eager.jsonl"
checkpoint

# One `vellum serve` run: $1 model, $2 clients, $3 prompts, $4 label, then flags.
serve() {
    local model=$1 clients=$2 count=$3 label=$4
    shift 4
    RUST_LOG=vellum_backend_cuda=info .gpu/x/vellum serve --device cuda --model "$model" --port 8011 --max-num-seqs 256 "$@" \
        >"$logs/serve_$label.log" 2>&1 &
    local pid=$!
    wait_up http://127.0.0.1:8011 60
    timeout 60 .gpu/x/vellum bench serve --base-url http://127.0.0.1:8011 --model "$model" --input-len 128 --output-len 128 \
        --num-prompts "$count" --max-concurrency "$clients" --json >"$logs/serve_$label.json" 2>>"$logs/serve_$label.log"
    python3 - "$logs/serve_$label.json" "$label" <<'PY'
import json, sys, urllib.request
try:
    v = json.load(open(sys.argv[1]))
    text = urllib.request.urlopen("http://127.0.0.1:8011/metrics").read().decode()
except (OSError, ValueError) as err:
    sys.exit(f"serve {sys.argv[2]}: no result ({err})")
m = {l.split("{")[0]: float(l.split()[-1]) for l in text.splitlines() if l.startswith("vellum:engine_") and "le=" not in l}
g = lambda k: m.get("vellum:engine_" + k, 0.0)
def step_quantile(kind, q):
    # The bucket bound where the cumulative count reaches q of the steps.
    rows = [l for l in text.splitlines() if l.startswith("vellum:engine_step_execute_seconds_bucket") and f'kind="{kind}"' in l]
    cum = [(l.split('le="')[1].split('"')[0], float(l.split()[-1])) for l in rows]
    total = cum[-1][1] if cum else 0
    return next((b for b, c in cum if total and c >= q * total), "n/a")
steps, decodes = g("steps_total"), g("decode_steps_total")
mixed_s = g("execute_seconds_total") - g("decode_execute_seconds_total")
ms = lambda x, d=1: "n/a" if x is None else f"{x * 1e3:.{d}f}"
print(f"serve {sys.argv[2]}: {v['output_throughput']:,.0f} output tok/s, ITL median/p99 {ms(v['itl_s']['median'])}/"
      f"{ms(v['itl_s']['p99'])} ms, TTFT median {ms(v['ttft_s']['median'], 0)} ms; {steps:.0f} steps: "
      f"{decodes:.0f} uniform decodes at {g('decode_execute_seconds_total') / max(decodes, 1) * 1e3:.2f} ms, "
      f"{steps - decodes:.0f} others at {mixed_s / max(steps - decodes, 1) * 1e3:.2f} ms; step p50/p99 bucket bounds (s): "
      f"decode {step_quantile('decode', 0.5)}/{step_quantile('decode', 0.99)}, others {step_quantile('other', 0.5)}/{step_quantile('other', 0.99)}")
PY
    echo "  (mixed graphs recorded: $(grep -c 'mixed=true' "$logs/serve_$label.log"))"
    kill "$pid"
    wait "$pid" 2>/dev/null
    checkpoint
}

if fits 20; then
    timeout 30 .gpu/x/vellum bench latency --device cuda --model "$smol" --batch-size 256 --input-len 128 --output-len 128 \
        --num-iters 2 --json 2>"$logs/latency_256.log" >"$logs/latency_256.json"
    python3 - "$logs/latency_256.json" <<'PY'
import json, sys
try:
    print("bench latency, SmolLM2 decode at 256:", round(json.load(open(sys.argv[1]))["decode_tokens_per_s"]), "tok/s")
except (OSError, ValueError, KeyError) as err:
    print(f"bench latency, SmolLM2 decode at 256: no result ({err!r})")
PY
    # The same requests offline (the engine without HTTP, prefill included):
    # what serving can reach, against which its overhead shows.
    timeout 40 .gpu/x/vellum bench throughput --device cuda --model "$smol" --input-len 128 --output-len 128 \
        --num-prompts "${PROMPTS:-1024}" --max-num-seqs 256 --json 2>"$logs/throughput.log" >"$logs/throughput.json"
    python3 - "$logs/throughput.json" <<'PY'
import json, sys
try:
    print("bench throughput, SmolLM2, the serving requests offline:", round(json.load(open(sys.argv[1]))["output_tokens_per_s"]), "output tok/s")
except (OSError, ValueError, KeyError) as err:
    print(f"bench throughput: no result ({err!r})")
PY
fi
for round in 1 2; do
    for mode in decode_only full; do
        fits 45 || break 2
        flags=()
        [ "$mode" = full ] && flags=(--compilation-config "$full")
        serve "$smol" "${CLIENTS:-256}" "${PROMPTS:-1024}" "smol_256_${mode}_$round" "${flags[@]}"
    done
done

m8=/tmp/m8.gguf
if { [ -f "$m8" ] && fits 110; } || fits 200; then
    [ -f "$m8" ] || timeout 90 .gpu/x/write_random_checkpoint --shape llama3-8b --format gguf --dtype q8_0 --out "$m8" >/dev/null 2>&1
    stamp "8b ready, exit $?"
    for mode in decode_only full; do
        fits 50 || break
        flags=()
        [ "$mode" = full ] && flags=(--compilation-config "$full")
        serve "$m8" 64 256 "8b_64_$mode" "${flags[@]}"
    done
fi
stamp "done"
exec >&- 2>&-
