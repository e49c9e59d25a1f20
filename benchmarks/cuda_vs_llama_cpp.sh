#!/usr/bin/env bash
# Vellum's CUDA backend against llama.cpp's CUDA build on the same GPU and
# the same GGUF file: `vellum bench latency --device cuda` against
# `llama-batched-bench -ngl 99 -fa on`, prompts of IN tokens and OUT
# generated, at BATCHES sequences, in ROUNDS alternated rounds; medians and
# ratios in a table, every row in $OUT/cuda_vs_llama_cpp.jsonl.
#
# Here (network and Rust; the GPU machine has neither):
#   kernels/cuda/gpu_suite.sh stage               # vellum and the writer into .gpu/
#   benchmarks/cuda_vs_llama_cpp.sh pack          # llama.cpp's tree (the llama-cpp-python
#                                                 # 0.3.36 sdist's, without models/, docs/,
#                                                 # tests/, examples/: ~6 MB) -> .gpu-llama/
# There (`device` tool: carry .gpu and .gpu-llama):
#   bash benchmarks/cuda_vs_llama_cpp.sh build    # llama-batched-bench with CUDA for the
#                                                 # GPU's architecture (~4 min on 16 cores)
#   bash benchmarks/cuda_vs_llama_cpp.sh model llama3-8b-q8_0 /tmp/m.gguf
#                                                 # a random-weight Llama 3 8B Q8_0 (8.5 GB)
#   bash benchmarks/cuda_vs_llama_cpp.sh run /tmp/m.gguf LABEL
#   VARIANTS="graphs:;eager:--enforce-eager" bash benchmarks/cuda_vs_llama_cpp.sh run /tmp/m.gguf LABEL
#                                                 # several Vellum configurations a round
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TREE=${LLAMA_TREE:-/tmp/llama.cpp}
BIN=$TREE/build/bin
out=${OUT:-$ROOT/.gpu/out}
# Each run's own output goes under logs/, the rows and the table beside it.
mkdir -p "$out/logs"

case "${1:-}" in
pack)
    mkdir -p .gpu-llama
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==0.3.36" -d "$tmp" >&2
    tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
    tar -C "$tmp/llama_cpp_python-0.3.36/vendor" -cJf .gpu-llama/llama.cpp.tar.xz \
        --exclude=llama.cpp/models --exclude=llama.cpp/docs --exclude=llama.cpp/tests --exclude=llama.cpp/examples \
        --exclude=llama.cpp/benches --exclude=llama.cpp/media --exclude=llama.cpp/tools/ui llama.cpp
    rm -rf "$tmp"
    ls -la .gpu-llama/llama.cpp.tar.xz
    ;;
build)
    [ -x "$BIN/llama-batched-bench" ] && { echo "$BIN/llama-batched-bench"; exit 0; }
    mkdir -p "$(dirname "$TREE")"
    tar -xJf .gpu-llama/llama.cpp.tar.xz -C "$(dirname "$TREE")"
    export PATH="/usr/local/cuda/bin:$PATH"
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
    cmake -S "$TREE" -B "$TREE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" \
        -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >"$out/logs/llama_build.log" 2>&1 &&
        cmake --build "$TREE/build" -j"$(nproc)" --target llama-batched-bench >>"$out/logs/llama_build.log" 2>&1
    rc=$?
    tail -3 "$out/logs/llama_build.log"
    exit $rc
    ;;
model)
    # A random-weight GGUF of a known shape: NAME = SHAPE-TYPE (llama3-8b-q8_0, llama3-1b-bf16, ...).
    name=$2 path=$3
    shape=${name%-*} ty=${name##*-}
    [ -f "$path" ] || .gpu/x/write_random_checkpoint --shape "$shape" --format gguf --dtype "$ty" --out "$path"
    ;;
run)
    # VARIANTS: Vellum's configurations, "NAME:FLAGS" separated by ";"
    # (default: one, "vellum:$VELLUM_ARGS"), each run in every round.
    model=$2 label=${3:-$(basename "$2")}
    rounds=${ROUNDS:-2} in=${IN:-128} gen=${GEN:-128} batches=${BATCHES:-1 64 256}
    variants=${VARIANTS:-"vellum:${VELLUM_ARGS:-}"}
    npl=$(echo "$batches" | tr ' ' ',')
    max_b=$(echo "$batches" | tr ' ' '\n' | sort -n | tail -1)
    ctx=$(((in + gen) * max_b + 256))
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    rows="$out/cuda_vs_llama_cpp.jsonl"
    for r in $(seq 1 "$rounds"); do
        if [ ! -x "$BIN/llama-batched-bench" ]; then
            echo "== round $r: llama.cpp is not built ($BIN): its rows are left out" >&2
        else
        echo "== round $r: llama.cpp ($label)" >&2
        "$BIN/llama-batched-bench" -m "$model" -ngl 99 -fa on -c "$ctx" -b 2048 -ub 512 -npp "$in" -ntg "$gen" -npl "$npl" \
            >"$out/logs/llama_${label}_$r.log" 2>&1 || { tail -5 "$out/logs/llama_${label}_$r.log"; exit 1; }
        python3 - "$out/logs/llama_${label}_$r.log" "$label" "$r" "$gpu" >>"$rows" <<'EOF'
import json, sys
log, label, r, gpu = sys.argv[1:]
for line in open(log):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 10 and cells[0].isdigit():
        pp, tg, b = int(cells[0]), int(cells[1]), int(cells[2])
        print(json.dumps({"engine": "llama.cpp", "model": label, "gpu": gpu, "round": int(r), "batch": b,
                          "prefill_tok_s": float(cells[5]), "decode_tok_s": float(cells[7])}))
EOF
        fi
        IFS=';' read -ra vs <<<"$variants"
        for v in "${vs[@]}"; do
            name=${v%%:*} flags=${v#*:}
            for b in $batches; do
                echo "== round $r: $name ($label, batch $b)" >&2
                base="$out/logs/${name}_${label}_${b}_$r"
                # shellcheck disable=SC2086 # the flags are words
                .gpu/x/vellum bench latency --device cuda --model "$model" --batch-size "$b" --input-len "$in" --output-len "$gen" \
                    --num-iters-warmup 1 --num-iters 2 --max-model-len $((in + gen + 16)) $flags --json \
                    >"$base.json" 2>"$base.log" || { tail -5 "$base.log"; exit 1; }
                python3 - "$base.json" "$label" "$r" "$gpu" "$name" >>"$rows" <<'EOF'
import json, sys
path, label, r, gpu, name = sys.argv[1:]
v = json.load(open(path))
print(json.dumps({"engine": name, "model": label, "gpu": gpu, "round": int(r), "batch": v["batch_size"],
                  "prefill_tok_s": v["prefill_tokens_per_s"], "decode_tok_s": v["decode_tokens_per_s"],
                  "time_share": v["time_share"]}))
EOF
            done
        done
    done
    python3 - "$rows" "$label" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r["model"] == sys.argv[2]]
engines = [e for e in dict.fromkeys(r["engine"] for r in rows) if e != "llama.cpp"]
print(f"\n{sys.argv[2]} on {rows[0]['gpu']} (medians of {max(r['round'] for r in rows)} alternated rounds; tok/s; ratio to llama.cpp)")
print("| engine | batch | llama.cpp prefill | prefill | ratio | llama.cpp decode | decode | ratio |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for e in engines:
    for b in sorted({r["batch"] for r in rows}):
        med = lambda e, k: statistics.median([r[k] for r in rows if r["engine"] == e and r["batch"] == b] or [float("nan")])
        lp, vp, ld, vd = med("llama.cpp", "prefill_tok_s"), med(e, "prefill_tok_s"), med("llama.cpp", "decode_tok_s"), med(e, "decode_tok_s")
        print(f"| {e} | {b} | {lp:,.0f} | {vp:,.0f} | {vp / lp:.2f}x | {ld:,.0f} | {vd:,.0f} | {vd / ld:.2f}x |")
EOF
    ;;
*)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
