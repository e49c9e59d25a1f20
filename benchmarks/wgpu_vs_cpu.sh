#!/usr/bin/env bash
# The WGSL backend (`--device wgpu`) next to the CPU backend, same run, same
# model and workloads: prefill and decode tokens/s from `vellum bench
# latency`, then the wgpu run's per-kernel time shares (timestamp queries,
# VELLUM_WGPU_PROFILE=1).
#
#   benchmarks/wgpu_vs_cpu.sh                    # batch 1 and 16, 128 in / 32 out
#   WORKLOADS="1:128:64" benchmarks/wgpu_vs_cpu.sh
#
# On a machine without a GPU the adapter is lavapipe (Mesa's Vulkan on the
# CPU: `apt-get install mesa-vulkan-drivers libvulkan1`), an emulation whose
# figures are a functional baseline, not a GPU's speed.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKLOADS=${WORKLOADS:-"1:128:32 16:128:32"}   # batch:input:output
ITERS=${ITERS:-2}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}
cargo build --release --locked -p vellum-server --features wgpu >&2
VELLUM=./target/release/vellum
printf "| workload | device | prefill tok/s | decode tok/s | latency s |\n|---|---|---|---|---|\n"
for w in $WORKLOADS; do
    IFS=: read -r B IN OUT <<<"$w"
    for dev in cpu wgpu; do
        $VELLUM bench latency --device "$dev" --batch-size "$B" --input-len "$IN" --output-len "$OUT" \
            --num-iters "$ITERS" --num-iters-warmup 1 --kv-cache-memory 512MiB --json 2>/dev/null |
            python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"| {$B} × ({$IN} in, {$OUT} out) | $dev | {d['prefill_tokens_per_s']:.1f} | {d['decode_tokens_per_s']:.1f} | {d['avg_latency_s']:.2f} |\")"
    done
done
for w in $WORKLOADS; do
    IFS=: read -r B IN OUT <<<"$w"
    echo
    echo "wgpu kernel time, batch $B ($IN in, $OUT out):"
    NO_COLOR=1 VELLUM_WGPU_PROFILE=1 $VELLUM bench latency --device wgpu --batch-size "$B" --input-len "$IN" --output-len "$OUT" \
        --num-iters 1 --num-iters-warmup 0 --kv-cache-memory 512MiB 2>&1 >/dev/null |
        sed 's/\x1b\[[0-9;]*m//g' | grep "wgpu kernel time" | sed -E 's/.*kernel="?([a-z_]+)"? dispatches=([0-9]+) ms="?([0-9.]+)"? share="?([0-9.%]+)"?.*/  \1: \4 (\3 ms, \2 dispatches)/'
done
