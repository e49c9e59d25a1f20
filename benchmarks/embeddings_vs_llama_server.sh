#!/usr/bin/env bash
# Embeddings: `vellum serve --task embed` against llama.cpp's `llama-server
# --embedding` on the same GGUF file and thread count, driven by the same
# client (benchmarks/embeddings_client.py: one fixed corpus, requests of
# BATCH inputs from CONCURRENCY clients), last-token pooling, L2-normalized
# on both sides. Alternates ROUNDS rounds, then compares the vectors: the
# cosine between Vellum's and llama.cpp's for every input.
#
#   benchmarks/embeddings_vs_llama_server.sh            # builds llama-server if needed (benchmarks/llama_cpp.sh)
#   LLAMA_CPP_BIN=/dir benchmarks/embeddings_vs_llama_server.sh
#   BERT=1 benchmarks/embeddings_vs_llama_server.sh     # an encoder instead: a bge-small-shaped random
#       BERT written twice with the same weights (benchmarks/make_bert_pair.py: a Hugging Face
#       directory for Vellum, a GGUF for llama.cpp), CLS pooling
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-$HOME/.cache/vellum/SmolLM2-135M-Instruct.Q4_1.gguf}
POOLING=${POOLING:-last}
THREADS=${THREADS:-2}
INPUTS=${INPUTS:-256}
BATCH=${BATCH:-16}
CONCURRENCY=${CONCURRENCY:-4}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-target/bench-embeddings}
VELLUM=target/release/vellum
mkdir -p "$OUT"
: > "$OUT/results.jsonl"

cargo build --release -p vellum-server
LLAMA_BIN=$(benchmarks/llama_cpp.sh)
if [ -n "${BERT:-}" ]; then
    python3 -m pip install --quiet numpy safetensors
    python3 benchmarks/make_bert_pair.py "$OUT/bert"
    MODEL=$OUT/bert/hf LLAMA_MODEL=$OUT/bert/bert.gguf POOLING=cls
fi
[ -e "$MODEL" ] || "$VELLUM" generate --prompt hi --max-tokens 1 >/dev/null  # fetches the default model
LLAMA_MODEL=${LLAMA_MODEL:-$MODEL}

. benchmarks/lib.sh  # wait_up

run_vellum() {  # label precision
    RAYON_NUM_THREADS=$THREADS "$VELLUM" serve "$MODEL" --port 8110 --served-model-name smol --task embed \
        --pooler-config "{\"pooling_type\": \"${POOLING^^}\", \"normalize\": true}" --cpu-precision "$2" \
        --kv-cache-memory 1GiB --max-model-len 2048 > "$OUT/$1.log" 2>&1 &
    local pid=$!
    wait_up http://127.0.0.1:8110
    python3 benchmarks/embeddings_client.py http://127.0.0.1:8110 "$1" "$OUT" \
        --inputs "$INPUTS" --batch "$BATCH" --concurrency "$CONCURRENCY" | tee -a "$OUT/results.jsonl"
    kill -TERM $pid; wait $pid || true
}

run_llama() {  # label
    # Every input of a request in one micro-batch (llama.cpp embeds a
    # sequence whole); CONCURRENCY slots.
    "$LLAMA_BIN/llama-server" -m "$LLAMA_MODEL" --host 127.0.0.1 --port 8111 -t "$THREADS" -tb "$THREADS" \
        --embedding --pooling "$POOLING" -np "$CONCURRENCY" -c $((CONCURRENCY * 2048)) -b 4096 -ub 4096 \
        > "$OUT/$1.log" 2>&1 &
    local pid=$!
    wait_up http://127.0.0.1:8111
    python3 benchmarks/embeddings_client.py http://127.0.0.1:8111 "$1" "$OUT" \
        --inputs "$INPUTS" --batch "$BATCH" --concurrency "$CONCURRENCY" | tee -a "$OUT/results.jsonl"
    kill -TERM $pid; wait $pid || true
}

for r in $(seq 1 "$ROUNDS"); do
    run_vellum "vellum-int8-r$r" int8
    run_llama "llama-server-r$r"
done
run_vellum vellum-float32 float32

python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, math, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
load = lambda label: json.load(open(f"{out}/{label}.json"))
def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
ref = load(f"llama-server-r{rounds}")
for label in (f"vellum-int8-r{rounds}", "vellum-float32"):
    cs = sorted(cos(a, b) for a, b in zip(load(label), ref))
    print(f"{label} vs llama-server: cosine min {cs[0]:.5f}, median {statistics.median(cs):.5f}")
rows = [json.loads(l) for l in open(f"{out}/results.jsonl")]
for name in ("vellum-int8", "llama-server"):
    rates = [r["prompt_tokens_per_s"] for r in rows if r["label"].startswith(name + "-r")]
    print(f"{name}: prompt tokens/s per round {rates}, median {statistics.median(rates):.0f}")
EOF
