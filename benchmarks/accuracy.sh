#!/usr/bin/env bash
# How close the quantized CPU paths are to exact arithmetic, Vellum and
# llama.cpp on the same file and the same text, same run:
#
#   benchmarks/accuracy.sh                      # the default model
#   MODEL=gemma3-270m benchmarks/accuracy.sh
#
# 1. KL divergence: each engine's quantized run against its own float32 run
#    (llama.cpp: `llama-perplexity --kl-divergence` against the file
#    requantized to F32; Vellum: crates/engine/examples/accuracy.rs against
#    `--cpu-precision float32`, in llama-perplexity's shape: 16 chunks of
#    512 tokens, the second half of each scored). The text is built from
#    files every Debian machine has (licence texts, Python 3.11's
#    textwrap.py) and a fixed revision of docs/reliability.md; its sha256 is
#    checked so that figures compare across runs.
# 2. Greedy agreement with independent float64 references on prompts the
#    golden files do not hold (benchmarks/accuracy/heldout-*: 32 prompts and
#    the references `reference_llama.py` / `reference_gemma3.py` of
#    ../shared/golden computed on them), walked as tests/golden.rs walks
#    the golden files; llama.cpp's through benchmarks/llama_cpp_logprobs.py.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m}
THREADS=${THREADS:-2}
BIN=$(EXTRA_TARGETS="llama-perplexity llama-quantize" benchmarks/llama_cpp.sh)
cargo build --release --locked -p vellum-server -p vellum-engine --example accuracy >&2
VELLUM=./target/release/vellum
$VELLUM generate --model "$MODEL" --prompt hi --max-tokens 1 >/dev/null 2>&1
CACHE=${VELLUM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vellum}
case "$MODEL" in
    smollm2-135m) FILE=$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf; HELD=smollm2 ;;
    gemma3-270m) FILE=$CACHE/gemma-3-270m-q4_k_m.gguf; HELD=gemma3 ;;
    *) echo "MODEL must be smollm2-135m or gemma3-270m (the held-out references are for those)" >&2; exit 1 ;;
esac
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

CORPUS=$WORK/corpus.txt
python3 - "$CORPUS" <<'EOF'
import subprocess, sys
parts = [open("/usr/share/common-licenses/GPL-3").read()[:20000],
         open("/usr/lib/python3.11/textwrap.py").read(),
         subprocess.run(["git", "show", "4135ddf:docs/reliability.md"], capture_output=True, text=True, check=True).stdout[:15000],
         open("/usr/share/common-licenses/Apache-2.0").read()]
open(sys.argv[1], "w").write("\n\n".join(parts))
EOF
SUM=$(sha256sum "$CORPUS" | cut -d' ' -f1)
[ "$SUM" = d6ffb30f7e99290f16ac481f6ed71f9889ad4655a80129000b6290683a20068f ] \
    || echo "note: this machine's text differs from the one docs/benchmarks.md measured on (sha256 $SUM)" >&2

echo "== llama.cpp: Q against its own F32 run" >&2
"$BIN/llama-quantize" --allow-requantize "$FILE" "$WORK/f32.gguf" F32 >/dev/null 2>&1
"$BIN/llama-perplexity" -m "$WORK/f32.gguf" -f "$CORPUS" -c 512 --chunks 16 -t "$THREADS" --kl-divergence-base "$WORK/base.kld" >/dev/null 2>&1
"$BIN/llama-perplexity" -m "$FILE" -f "$CORPUS" -c 512 --chunks 16 -t "$THREADS" --kl-divergence-base "$WORK/base.kld" --kl-divergence 2>&1 \
    | grep -E "Mean    KLD|99.0%   KLD|Same top p"

echo "== Vellum: int8 against its float32 path" >&2
./target/release/examples/accuracy --model "$MODEL" --text "$CORPUS" --chunks 16 \
    --config 'int8 (default)' --config 'int8 without outlier channels;outliers=off' 2>/dev/null

echo "== greedy agreement with the float64 references on the held-out prompts" >&2
REF=benchmarks/accuracy/heldout-$HELD-reference.json
$VELLUM generate --model "$MODEL" --json --logprobs 5 --max-tokens 16 --temperature 0 \
    --prompts-file "benchmarks/accuracy/heldout-$HELD-prompts.json" >"$WORK/vellum.jsonl" 2>/dev/null
echo -n "Vellum int8: "
python3 benchmarks/accuracy/golden_walk.py "$REF" "$WORK/vellum.jsonl"
for fa in on off; do
    echo -n "llama.cpp (flash attention $fa): "
    LLAMA_EXTRA="-fa $fa" python3 benchmarks/llama_cpp_logprobs.py "$BIN" "$FILE" "$REF" "$THREADS" | tail -1
done
