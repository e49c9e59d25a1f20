#!/usr/bin/env bash
# Vellum vs llama.cpp on the same GGUF file and thread count, same run.
#
#   benchmarks/run.sh                      # the default model, all workloads, a table with ratios
#   MODEL=gemma3-270m benchmarks/run.sh    # a short name or a .gguf path
#   THREADS=4 ROUNDS=3 benchmarks/run.sh
#
# The peer is llama.cpp's own `llama-batched-bench` (no sampling, random
# prompt tokens), built once from the llama-cpp-python 0.3.36 sdist by
# benchmarks/llama_cpp.sh. Vellum runs `vellum bench latency` on the same
# shapes: B sequences of IN prompt tokens, OUT tokens each, EOS ignored.
# Both report prefill tokens/s (B·IN / prefill time) and decode tokens/s
# (B·OUT / decode time). The two alternate for ROUNDS rounds, because
# adjacent runs on a shared machine differ by up to 30%; the table gives
# each side's median round. Raw results go to benchmarks/results/<date>.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
MODEL=${MODEL:-smollm2-135m}
WORKLOADS=${WORKLOADS:-"1:128:128 64:128:64"}   # batch:input:output

BIN=$(benchmarks/llama_cpp.sh)
cargo build --release --locked -p vellum-server >&2
VELLUM=./target/release/vellum
# Fetches a known model if needed; then its path.
$VELLUM generate --model "$MODEL" --prompt hi --max-tokens 1 --kv-cache-memory 64MiB >/dev/null 2>&1
CACHE=${VELLUM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vellum}
case "$MODEL" in
    smollm2-135m) FILE=$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf ;;
    gemma3-270m) FILE=$CACHE/gemma-3-270m-q4_k_m.gguf ;;
    *) FILE=$MODEL ;;
esac
[ -f "$FILE" ] || { echo "model not found at $FILE" >&2; exit 1; }

mkdir -p benchmarks/results
OUT=benchmarks/results/$(date -u +%Y-%m-%d).jsonl
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)
RUN=$(date -u +%FT%TZ)
echo "== $RUN, $CPU, $THREADS threads, model $FILE" >&2

for round in $(seq "$ROUNDS"); do
    for w in $WORKLOADS; do
        IFS=: read -r B IN OUTLEN <<<"$w"
        echo "== round $round: batch $B, $IN in, $OUTLEN out" >&2
        v=$(RAYON_NUM_THREADS=$THREADS $VELLUM bench latency --model "$FILE" --batch-size "$B" --input-len "$IN" \
            --output-len "$OUTLEN" --num-iters 1 --num-iters-warmup 1 --kv-cache-memory 2GiB --json 2>/dev/null)
        l=$("$BIN/llama-batched-bench" -m "$FILE" -t "$THREADS" -c $((B * (IN + OUTLEN) + 64)) -b 2048 -ub 512 \
            -npp "$IN" -ntg "$OUTLEN" -npl "$B" --output-format jsonl 2>/dev/null | grep '^{')
        echo "{\"run\": \"$RUN\", \"cpu\": \"$CPU\", \"threads\": $THREADS, \"model\": \"$(basename "$FILE")\", \"vellum\": $v, \"llama_cpp\": $l}" >>"$OUT"
    done
done

python3 - "$OUT" "$RUN" "$ROUNDS" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("run") == sys.argv[2]]
print(f"model {rows[0]['model']}, {rows[0]['threads']} threads, median over {sys.argv[3]} rounds")
print(f"{'workload':<28}{'metric':<16}{'vellum':>10}{'llama.cpp':>11}{'ratio':>8}")
by = {}
for r in rows:
    by.setdefault((r['vellum']['batch_size'], r['vellum']['input_len'], r['vellum']['output_len']), []).append(r)
for (b, i, o), rs in by.items():
    for vm, lm, name in [("prefill_tokens_per_s", "speed_pp", "prefill tok/s"), ("decode_tokens_per_s", "speed_tg", "decode tok/s")]:
        v = statistics.median(r['vellum'][vm] for r in rs)
        l = statistics.median(r['llama_cpp'][lm] for r in rs)
        print(f"{f'{b} seq x ({i} in, {o} out)':<28}{name:<16}{v:>10.1f}{l:>11.1f}{v / l:>7.2f}x")
PY
