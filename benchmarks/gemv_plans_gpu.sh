#!/usr/bin/env bash
# The decode GEMV's plans (gemv_q.cu's knobs) and sampling on the device,
# checked and measured in one call on a GPU machine (no Rust, no network),
# with .gpu/ carried:
#
#   kernels/cuda/gpu_suite.sh stage      # here
#   bash benchmarks/gemv_plans_gpu.sh    # there (BUDGET_S, default 540)
#
# 1. gemm_bench --gemv-plans: weight GB/s of each plan at 1, 2, 4 and 8 rows
#    on Llama 3 8B's shapes (the k/v projection and the LM head included),
#    the tensor-core GEMM beside them from 2 rows; the plan with the least
#    time summed over the Q8_0 shapes at 1 row is "best";
# 2. the GPU suite's GEMV test (every layout against the float64 product,
#    under the default plans and four others, 4:2:1 among them), and the
#    device-sampling test (its timing line: 256 rows of 1,000 and of
#    262,144);
# 3. a Llama-3-8B-shaped Q8_0 written there: single-stream decode (128 in,
#    128 out) with the default plan and with the best one;
# 4. decode at 256 sequences, greedy and sampled on the device (temperature
#    0.8, top-p 0.95), on a SmolLM2-shaped Q4_1 and on a Q8_0 of Gemma 3
#    270M's size and vocabulary (`--shape gemma3-270m-sized`);
# 5. if time allows, `vellum serve` on the SmolLM2 shape at 256 clients: the
#    steps that were uniform decodes and the executor's seconds on them and
#    on the rest.
# A step starts only if the budget leaves it room. $OUT gets summary.txt as
# it runs, gemv.jsonl, and logs.tgz after every step (the device tool
# returns few files; a run cut short keeps what it had).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.gpu/out}
logs=$(mktemp -d)
t0=$SECONDS
budget=${BUDGET_S:-540}
mkdir -p "$out"
exec > >(tee "$out/summary.txt") 2>&1
tee_pid=$!
. benchmarks/lib.sh  # stamp, fits, wait_up
checkpoint() { tar -C "$logs" -czf "$out/logs.tgz" . 2>/dev/null; }
# shellcheck disable=SC1091 # staged there
source .gpu/run.sh env >/dev/null
plans=${PLANS:-"1:1:0,1:1:1,2:1:1,1:2:1,2:2:1,4:2:1"}

timeout 150 .gpu/x/gemm_bench --gemv-plans "$plans" >"$logs/gemv.jsonl" 2>"$logs/gemv.log"
stamp "gemm_bench exit $?"
cp "$logs/gemv.jsonl" "$out/gemv.jsonl"
checkpoint
best=$(python3 - "$logs/gemv.jsonl" <<'EOF'
import json, sys, collections
t = collections.Counter()
for l in open(sys.argv[1]):
    if l.startswith("{"):
        r = json.loads(l)
        if r["rows"] == 1 and r["weight"].startswith("Q8_0"):
            t[r["path"].split()[1]] += r["ms"]
print(min(t, key=t.get) if t else "")
EOF
)
stamp "best plan at 1 row: ${best:-none measured}"

# The test runs the default plans, 2:2:1, 4:2:1, 1:1:0 and 3:4:1 itself;
# the best one too when it is none of those.
for plan in default $(printf '%s\n' "$best" | grep -vxE '|2:2:1|4:2:1|1:1:0|3:4:1'); do
    fits 90 || break
    gemv=$plan
    [ "$plan" = default ] && gemv=""
    VELLUM_GEMV=$gemv timeout 90 .gpu/x/gpu_suite --test-threads 1 gemv_and_cuda_core_gemm >"$logs/suite_gemv_$plan.txt" 2>&1
    stamp "gemv test (plan $plan) exit $?"
done
checkpoint

m8=/tmp/m8.gguf
if fits 150; then
    timeout 90 .gpu/x/write_random_checkpoint --shape llama3-8b --format gguf --dtype q8_0 --out "$m8" >/dev/null 2>&1
    stamp "8b written, exit $?"
    for plan in default ${best:+"$best"}; do
        fits 60 || break
        gemv=$plan
        [ "$plan" = default ] && gemv=""
        VELLUM_GEMV=$gemv timeout 60 .gpu/x/vellum bench latency --device cuda --model "$m8" --batch-size 1 --input-len 128 \
            --output-len 128 --num-iters 2 --json 2>"$logs/m8_$plan.log" >"$logs/m8_$plan.json"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('8B Q8_0 single-stream decode, plan $plan:', round(d['decode_tokens_per_s'], 1), 'tok/s')" "$logs/m8_$plan.json"
    done
    checkpoint
fi

if fits 60; then
    timeout 60 .gpu/x/device_sampling --test-threads 1 --nocapture >"$logs/sampling.txt" 2>&1
    stamp "device sampling test exit $?"
    grep -h "sampling took\|panicked" "$logs/sampling.txt" | cut -c1-200
fi

smol=/tmp/smollm2-135m-q4_1.gguf
g270=/tmp/gemma3-270m-sized-q8_0.gguf
timeout 60 .gpu/x/write_random_checkpoint --shape smollm2-135m --format gguf --dtype q4_1 --out "$smol" >/dev/null 2>&1
for model in smol g270; do
    path=$smol
    if [ "$model" = g270 ]; then
        # Gemma 3 270M's size and 262,144-token vocabulary in the Llama
        # layout: the step-overhead issue's "sampled ≥ 90% of greedy" row,
        # by proxy.
        fits 100 || break
        path=$g270
        timeout 60 .gpu/x/write_random_checkpoint --shape gemma3-270m-sized --format gguf --dtype q8_0 --out "$path" >/dev/null 2>&1
    fi
    for mode in greedy sampled; do
        fits 45 || break
        flags="--temperature 0.8 --top-p 0.95"
        [ "$mode" = greedy ] && flags=""
        # shellcheck disable=SC2086
        timeout 45 .gpu/x/vellum bench latency --device cuda --model "$path" --batch-size 256 --input-len 128 --output-len 128 \
            --num-iters 2 --json $flags 2>"$logs/${model}_$mode.log" >"$logs/${model}_$mode.json"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('$model decode at 256, $mode:', round(d['decode_tokens_per_s']), 'tok/s')" "$logs/${model}_$mode.json"
    done
done
checkpoint

# Serving at 256 clients (graphs): how many steps were uniform decodes and
# what the executor spent on them and on the rest.
if fits 60; then
    .gpu/x/vellum serve --device cuda --model "$smol" --port 8011 --max-num-seqs 256 >"$logs/serve.log" 2>&1 &
    pid=$!
    wait_up http://127.0.0.1:8011 30
    timeout 45 .gpu/x/vellum bench serve --base-url http://127.0.0.1:8011 --model "$smol" --input-len 128 --output-len 128 \
        --num-prompts 1024 --max-concurrency 256 --json >"$logs/serve_256.json" 2>>"$logs/serve.log"
    python3 - "$logs/serve_256.json" <<'PY'
import json, sys, urllib.request
v = json.load(open(sys.argv[1]))
m = {l.split("{")[0]: float(l.split()[-1]) for l in urllib.request.urlopen("http://127.0.0.1:8011/metrics").read().decode().splitlines()
     if l.startswith("vellum:engine_")}
g = lambda k: m.get("vellum:engine_" + k, 0.0)
print(f"serve, 256 clients: {v['output_throughput']:,.0f} output tok/s in {v['duration_s']:.2f} s, ITL median/p99 "
      f"{(v['itl_s']['median'] or 0) * 1e3:.1f}/{(v['itl_s']['p99'] or 0) * 1e3:.1f} ms; steps {g('steps_total'):.0f} "
      f"({g('decode_steps_total'):.0f} uniform decodes, {g('decode_execute_seconds_total'):.2f} s executing; the rest "
      f"{g('execute_seconds_total') - g('decode_execute_seconds_total'):.2f} s); schedule {g('schedule_seconds_total'):.2f} s, "
      f"sample {g('sample_seconds_total'):.2f} s, output {g('output_seconds_total'):.2f} s")
PY
    kill "$pid"
    wait "$pid" 2>/dev/null
    checkpoint
fi
stamp "done"
grep -H "test result" "$logs"/suite_gemv_*.txt | sed "s|$logs/||" | cut -c1-200
sed -n '/^| weight/,$p' "$logs/gemv.jsonl"
# Let tee write the last lines to summary.txt before the script ends.
exec >&- 2>&-
wait "$tee_pid" 2>/dev/null
