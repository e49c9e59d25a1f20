#!/usr/bin/env bash
# The golden prompts through --device cuda on a GPU machine, the default
# model's file (98 MB) carried in two calls because one call carries at
# most 64 MiB. Three steps:
#
#   bash benchmarks/golden_gpu.sh split     # here: .gpu-golden/a and b
#   bash benchmarks/golden_gpu.sh stash     # there, carrying .gpu-golden/a:
#                                           #   kept in /tmp while the machine
#                                           #   stays warm (30 s)
#   bash benchmarks/golden_gpu.sh run       # there, at once, carrying .gpu and
#                                           #   .gpu-golden/b
#
# `run` joins the halves (checking the SHA-256 taken here), then runs
# tests/golden.rs's CUDA tests (float32 path against the 0.02-nats rule,
# bf16 path against llama.cpp's gaps, chunking/prefix/batching invariance)
# twice: on the plain executor, and with VELLUM_TP_COLLECTIVE=1 — the
# tensor-parallel path over an NCCL group of one, the parallelism issue's
# single-GPU check. The table last.
set -uo pipefail
cd "$(dirname "$0")/.."
name=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
split)
    src=${VELLUM_CACHE:-$HOME/.cache/vellum}/$name
    [ -f "$src" ] || { echo "no $src: run the README's first command once to download it" >&2; exit 1; }
    mkdir -p .gpu-golden
    head -c 55000000 "$src" >.gpu-golden/a
    tail -c +55000001 "$src" >.gpu-golden/b
    sha256sum "$src" | cut -d' ' -f1 >.gpu-golden/b.sha256
    ls -la .gpu-golden
    ;;
stash)
    cp .gpu-golden/a /tmp/vellum-golden.a && ls -la /tmp/vellum-golden.a
    ;;
run)
    out=${OUT:-.gpu/out}
    mkdir -p .gpu/models "$out"
    cat /tmp/vellum-golden.a .gpu-golden/b >".gpu/models/$name" || exit 1
    want=$(cat .gpu-golden/b.sha256)
    got=$(sha256sum ".gpu/models/$name" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "the joined file's SHA-256 $got is not $want" >&2; exit 1; }
    # shellcheck disable=SC1091 # staged there
    source .gpu/run.sh env >/dev/null
    for mode in plain collective; do
        collective=0
        [ "$mode" = collective ] && collective=1
        VELLUM_TP_COLLECTIVE=$collective timeout 200 .gpu/x/golden --test-threads 1 --nocapture cuda >"$out/golden_$mode.txt" 2>&1
        echo "golden ($mode): exit $?"
        grep -E "^test |test result|agree|largest|SKIPPED|panicked" "$out/golden_$mode.txt" | cut -c1-200
    done
    ;;
*)
    echo "usage: $0 split|stash|run" >&2
    exit 2
    ;;
esac
