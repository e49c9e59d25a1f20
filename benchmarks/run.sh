#!/usr/bin/env bash
# Vellum vs llama.cpp on the same GGUF file and thread count, same run.
#
#   benchmarks/run.sh            # all workloads, prints a table with ratios
#   THREADS=4 benchmarks/run.sh  # another thread count
#
# llama.cpp comes in as an ordinary package: llama-cpp-python, built from
# source by pip into benchmarks/.venv on first use (about 20-30 minutes on 2
# cores). Each workload is B sequences of IN random prompt tokens and OUT
# greedy tokens, EOS ignored; both systems report prefill tokens/s (prompt
# tokens / time to every sequence's first token) and decode tokens/s.
# Results also go to benchmarks/results/<date>.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
VENV=${VENV:-benchmarks/.venv}
ITERS=${ITERS:-2}
WORKLOADS=${WORKLOADS:-"1:128:128 64:128:128"}   # batch:input:output

if ! "$VENV/bin/python" -c "import llama_cpp, numpy" 2>/dev/null; then
    echo "== installing llama-cpp-python into $VENV (builds llama.cpp from source)" >&2
    python3 -m venv "$VENV"
    # Native build (AVX-512 where the CPU has it), the library only.
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF" \
        "$VENV/bin/pip" install --quiet --no-cache-dir --no-binary llama-cpp-python numpy "llama-cpp-python==0.3.36"
fi
cargo build --release --locked -p vellum-server >&2
VELLUM=./target/release/vellum
# Fetches the default model if needed; its path:
$VELLUM generate --prompt hi --max-tokens 1 --kv-cache-memory 64MiB >/dev/null 2>&1
CACHE=${VELLUM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vellum}
MODEL=$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || { echo "model not found at $MODEL" >&2; exit 1; }

mkdir -p benchmarks/results
OUT=benchmarks/results/$(date -u +%Y-%m-%d).jsonl
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)
echo "== $(date -u +%FT%TZ), $CPU, $THREADS threads, model $MODEL" >&2

for w in $WORKLOADS; do
    IFS=: read -r B IN OUTLEN <<<"$w"
    echo "== workload batch $B, $IN in, $OUTLEN out" >&2
    v=$(RAYON_NUM_THREADS=$THREADS $VELLUM bench latency --batch-size "$B" --input-len "$IN" --output-len "$OUTLEN" \
        --num-iters "$ITERS" --num-iters-warmup 1 --kv-cache-memory 2GiB --json 2>/dev/null)
    l=$("$VENV/bin/python" benchmarks/llama_cpp_bench.py --model "$MODEL" --batch-size "$B" --input-len "$IN" \
        --output-len "$OUTLEN" --threads "$THREADS" --num-iters "$ITERS" --num-iters-warmup 1)
    echo "{\"date\": \"$(date -u +%FT%TZ)\", \"cpu\": \"$CPU\", \"threads\": $THREADS, \"vellum\": $v, \"llama_cpp\": $l}" >>"$OUT"
done

python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'workload':<28}{'metric':<16}{'vellum':>10}{'llama.cpp':>11}{'ratio':>8}")
seen = {}  # the latest result of each workload today
for r in rows:
    seen[(r['vellum']['batch_size'], r['vellum']['input_len'], r['vellum']['output_len'])] = r
for (b, i, o), r in seen.items():
    for m, name in [("prefill_tokens_per_s", "prefill tok/s"), ("decode_tokens_per_s", "decode tok/s")]:
        v, l = r['vellum'][m], r['llama_cpp'][m]
        print(f"{f'{b} seq x ({i} in, {o} out)':<28}{name:<16}{v:>10.1f}{l:>11.1f}{v / l:>7.2f}x")
PY
