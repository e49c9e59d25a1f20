#!/usr/bin/env bash
# The CUDA GPU suite and benchmarks as one command on a machine that has an
# NVIDIA GPU and a driver but no Rust and no network.
#
#   kernels/cuda/gpu_suite.sh stage      # here: builds everything into .gpu/
#   bash .gpu/run.sh [STEP ...]          # there, with .gpu/ copied over (the
#                                        # device tool: carry [".gpu"])
#
# Steps (all of them by default):
#   suite       crates/backend-cuda/tests/gpu.rs: every kernel against float64
#               references, the executor against the CPU's f32 path
#   sampling    tests/device_sampling.rs: sampling on the device against the
#               host sampler's reference
#   attention   the paged-attention decode bandwidth benchmark
#               (examples/attention_bench.rs) -> $OUT/attention.jsonl
#   overheads   what a launch, an allocation and a copy cost on the host
#   prefill     (not in the default set) prefill attention, flash prefill
#               against the decode kernels (attention_bench --prefill)
#               -> $OUT/prefill.jsonl
#   gemm        the linear layer's paths by batch rows at Llama 3 8B's
#               shapes (examples/gemm_bench.rs) -> $OUT/gemm.jsonl
#   golden      tests/golden.rs's CUDA tests (the golden prompts through
#               --device cuda); needs the default model in $VELLUM_CACHE
#   throughput  `vellum bench throughput --device cuda` on $VELLUM_MODEL (or
#               the default model) -> $OUT/throughput.json
#   bf16        (not in the default set) writes a Llama-3-8B-shaped bf16
#               Hugging Face directory there (write_random_checkpoint), then
#               `vellum bench latency --device cuda` at 1/64/256 requests ->
#               $OUT/bf16.jsonl
# Every test must find the GPU (VELLUM_REQUIRE_GPU). Logs go to $OUT (the
# device tool's) or .gpu/out. The kernels compile there with its own NVRTC
# (a CUDA toolkit's libnvrtc; NVRTC_DIR names its directory if run.sh's
# search misses it).
set -euo pipefail
cd "$(dirname "$0")/../.."

# The path of the executable `cargo $@ --message-format=json` builds for
# target name $1.
artifact() {
    local name=$1
    shift
    cargo "$@" --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$name"
}

case "${1:-}" in
stage)
    rm -rf .gpu/bin && mkdir -p .gpu/bin .gpu/golden
    declare -A bins=(
        [gpu_suite]="$(artifact gpu test -p vellum-backend-cuda --release --locked --test gpu --no-run)"
        [golden]="$(artifact golden test --release --locked --features cuda --test golden --no-run)"
        [device_sampling]="$(artifact device_sampling test --release --locked --features cuda --test device_sampling --no-run)"
        [attention_bench]="$(artifact attention_bench build -p vellum-backend-cuda --release --locked --example attention_bench)"
        [gemm_bench]="$(artifact gemm_bench build -p vellum-backend-cuda --release --locked --example gemm_bench)"
        [vellum]="$(artifact vellum build -p vellum-server --release --locked --features cuda --bin vellum)"
        [write_random_checkpoint]="$(artifact write_random_checkpoint build -p vellum-formats --release --locked --example write_random_checkpoint)"
    )
    for name in "${!bins[@]}"; do
        [ -n "${bins[$name]}" ] || { echo "building $name failed" >&2; exit 1; }
        # Without debug info and compressed: the device tool carries 64 MiB.
        strip --strip-debug -o ".gpu/bin/$name" "${bins[$name]}"
        xz -T2 -6 -f ".gpu/bin/$name"
    done
    cp ../shared/golden/*.json .gpu/golden/
    cp kernels/cuda/run_gpu.sh .gpu/run.sh
    # The commit staged (a `+` when the tree had changes), for the notes of
    # the run that uses it.
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu' || echo +)" >.gpu/COMMIT
    echo "staged $(du -sh .gpu | cut -f1) in .gpu/ at $(cat .gpu/COMMIT): run it there with bash .gpu/run.sh"
    ;;
*)
    echo "usage: $0 stage" >&2
    exit 2
    ;;
esac
