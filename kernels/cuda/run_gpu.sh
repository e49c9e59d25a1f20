#!/usr/bin/env bash
# Runs on the GPU machine from .gpu/ (kernels/cuda/gpu_suite.sh stage puts it
# there): `bash .gpu/run.sh [suite] [sampling] [attention] [overheads] [prefill] [gemm] [golden] [throughput] [bf16]`,
# or `source .gpu/run.sh env` to set up the libraries for commands of one's own.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out" "$here/x"
steps=${*:-suite sampling attention golden throughput}

for f in "$here"/bin/*.xz; do
    b="$here/x/$(basename "${f%.xz}")"
    [ -x "$b" ] || { xz -dc "$f" >"$b" 2>/dev/null || python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$f" "$b"; chmod +x "$b"; }
done

# CUDA libraries cudarc dlopens by their unversioned name: a toolkit's, or
# the ones torch's wheels bring. `use_lib NAME [DIR]` finds libNAME.so (DIR
# first), links it as /tmp/vellum-libs/libNAME.so and puts both directories
# on LD_LIBRARY_PATH.
wheel_dirs=$(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in os.listdir(p)))' 2>/dev/null)
use_lib() {
    local name=$1 first=${2:-} d f found=""
    for d in "$first" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $wheel_dirs /usr/lib/x86_64-linux-gnu; do
        [ -n "$d" ] || continue
        for f in "$d/lib$name.so" "$d/lib$name.so".1[0-9]* "$d/lib$name.so".2; do
            if [ -e "$f" ]; then found=$f; break 2; fi
        done
    done
    if [ -n "$found" ]; then
        mkdir -p /tmp/vellum-libs && ln -sf "$(readlink -f "$found")" "/tmp/vellum-libs/lib$name.so"
        export LD_LIBRARY_PATH="/tmp/vellum-libs:$(dirname "$(readlink -f "$found")")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    echo "lib$name: ${found:-not found}"
}
use_lib nvrtc "${NVRTC_DIR:-}"
# cuBLAS: bf16 weights on tensor cores (without it they are widened to f32).
use_lib cublas "${CUBLAS_DIR:-}"
# NCCL: tensor-parallel groups (the suite's single-rank group on one GPU).
use_lib nccl "${NCCL_DIR:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
export VELLUM_REQUIRE_GPU=1 VELLUM_GOLDEN_DIR="$here/golden" RUST_BACKTRACE=1
export VELLUM_CACHE=${VELLUM_CACHE:-$here/models}
# `source .gpu/run.sh env`: the binaries unpacked and the libraries found,
# for a script that runs them itself.
if [ "${1:-}" = env ]; then
    return 0 2>/dev/null || exit 0
fi

status=0
step() { # name timeout command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || status=1
}
for s in $steps; do
    case $s in
    # SUITE_FILTER: test-name filters (all tests when empty).
    suite)
        # shellcheck disable=SC2086 # the filters are words
        step suite "${SUITE_LIMIT:-300}" "$here/x/gpu_suite" --test-threads 1 --nocapture ${SUITE_FILTER:-}
        ;;
    attention) step attention "${ATTENTION_LIMIT:-240}" bash -c "'$here/x/attention_bench' ${ATTENTION_ARGS:-} > '$out/attention.jsonl'" ;;
    overheads) step overheads 120 "$here/x/attention_bench" --overheads ;;
    # Prefill attention: flash prefill against the decode kernels, TFLOP/s.
    prefill) step prefill "${PREFILL_LIMIT:-120}" bash -c "'$here/x/attention_bench' --prefill ${PREFILL_ARGS:---quick} > '$out/prefill.jsonl'" ;;
    # The paged decode kernels' loads (tiled values, prefetch) side by side, GB/s.
    loads) step loads "${LOADS_LIMIT:-120}" bash -c "'$here/x/attention_bench' --loads > '$out/loads.jsonl'" ;;
    gemm) step gemm "${GEMM_LIMIT:-240}" bash -c "'$here/x/gemm_bench' ${GEMM_ARGS:-} > '$out/gemm.jsonl'; rc=\$?; sed -n '/^| weight/,\$p' '$out/gemm.jsonl'; exit \$rc" ;;
    golden) step golden "${GOLDEN_LIMIT:-300}" "$here/x/golden" --test-threads 1 --nocapture cuda ;;
    sampling) step sampling "${SAMPLING_LIMIT:-120}" "$here/x/device_sampling" --test-threads 1 --nocapture ;;
    throughput)
        step throughput "${THROUGHPUT_LIMIT:-240}" "$here/x/vellum" bench throughput --device cuda ${VELLUM_MODEL:+--model "$VELLUM_MODEL"} \
            --input-len 128 --output-len 128 --num-prompts ${NUM_PROMPTS:-256} --json
        ;;
    bf16)
        # Llama-3-8B-shaped, bf16, as a sharded Hugging Face directory written
        # here (16 GB; no session can carry it), then the batch latency at 1,
        # 64 and 256 requests of 128 in / 128 out.
        dir=${BF16_DIR:-/tmp/vellum-llama3-8b-bf16}
        [ -f "$dir/model.safetensors.index.json" ] ||
            step write "${WRITE_LIMIT:-240}" "$here/x/write_random_checkpoint" --shape llama3-8b --dtype bf16 --out "$dir"
        step bf16 "${BF16_LIMIT:-420}" bash -c "for b in ${BF16_BATCHES:-1 64 256}; do '$here/x/vellum' bench latency --device cuda \
            --model '$dir' --batch-size \$b --input-len 128 --output-len 128 --num-iters 2 --json || exit 1; done > '$out/bf16.jsonl'"
        ;;
    *) echo "unknown step $s" && status=1 ;;
    esac
done
exit $status
