#!/usr/bin/env bash
# Speculative decoding, single stream: `vellum bench latency` on four chat
# prompts (benchmarks/prompts/: a text to correct, code to rename (which
# the default model answers in prose), code with a typo to fix (which it
# copies back), an open-ended story), without speculation and with n-gram
# prompt lookup, in
# alternated rounds; then llama.cpp's own prompt lookup (`llama-lookup`) on
# the same file and templated prompt. Prints one table; JSON lines in $OUT.
#
#   benchmarks/spec_decode.sh            (ROUNDS=3 OUTPUT_LEN=128 SPEC=... to change)
#
# llama-lookup is built beside the other llama.cpp tools
# (EXTRA_TARGETS=llama-lookup benchmarks/llama_cpp.sh); without it that
# column is left out.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-smollm2-135m}
GGUF=${GGUF:-$HOME/.cache/vellum/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUNDS=${ROUNDS:-3}
OUTPUT_LEN=${OUTPUT_LEN:-128}
THREADS=${THREADS:-2}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}
OUT=${OUT:-target/bench-spec}
VELLUM=target/release/vellum
mkdir -p "$OUT"
rm -f "$OUT"/runs.jsonl
cargo build --release -p vellum-server

for round in $(seq 1 "$ROUNDS"); do
    for w in rewrite_text rewrite_code fix_code chat; do
        for mode in plain ngram; do
            extra=()
            [ "$mode" = ngram ] && extra=(--speculative-config "$SPEC")
            "$VELLUM" bench latency --model "$MODEL" --batch-size 1 --output-len "$OUTPUT_LEN" --num-iters 2 \
                --prompt "$(cat benchmarks/prompts/$w.txt)" --chat --json "${extra[@]}" 2>/dev/null |
                python3 -c "import json,sys; d=json.load(sys.stdin); d.update(workload='$w', mode='$mode', round=$round); print(json.dumps(d))" \
                >>"$OUT"/runs.jsonl
        done
    done
done

LOOKUP=""
if BIN=$(EXTRA_TARGETS=llama-lookup benchmarks/llama_cpp.sh 2>/dev/null) && [ -x "$BIN/llama-lookup" ]; then
    LOOKUP=$BIN/llama-lookup
    for w in rewrite_text rewrite_code fix_code chat; do
        # SmolLM2's chat template with its default system prompt, as Vellum renders it.
        text=$(printf '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$(cat benchmarks/prompts/$w.txt)")
        LD_LIBRARY_PATH=$BIN "$LOOKUP" -m "$GGUF" -p "$text" -n "$OUTPUT_LEN" --spec-draft-n-max 4 -t "$THREADS" --temp 0 2>&1 |
            python3 -c "
import json, re, sys
t = sys.stdin.read()
speed = float(re.search(r'decoded .* speed: *([0-9.]+) t/s', t).group(1))
acc = float(re.search(r'accept *= *([0-9.]+)%', t).group(1)) / 100
print(json.dumps({'workload': '$w', 'mode': 'llama-lookup', 'decode_tokens_per_s': speed, 'acceptance_rate': acc}))" >>"$OUT"/runs.jsonl
    done
fi

# The table (shared with benchmarks/golden_gpu.sh's --device cuda step).
python3 benchmarks/spec_table.py "$OUT"/runs.jsonl
