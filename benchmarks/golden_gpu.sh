#!/usr/bin/env bash
# The golden prompts, then single-stream speculative decoding, through
# --device cuda on a GPU machine, the default model's file (98 MB) carried
# in two calls because one call carries at most 64 MiB:
#
#   kernels/cuda/gpu_suite.sh stage         # here: .gpu/ (12 MB, with vellum)
#   bash benchmarks/golden_gpu.sh split     # here: .gpu-golden/a (40 MB) and b
#   bash benchmarks/gpu_session.sh          # there, carrying .gpu, .gpu-llama
#                                           #   and .gpu-golden/a: keeps a in
#                                           #   /tmp while the machine stays
#                                           #   warm (30 s); or, alone,
#   bash benchmarks/golden_gpu.sh stash     #   carrying .gpu-golden/a
#   bash benchmarks/golden_gpu.sh run       # there, at once, carrying
#                                           #   .gpu-golden/b (58 MB; .gpu
#                                           #   stays from the call before,
#                                           #   or carry it too after `stash`)
#
# `run` joins the halves (checking the SHA-256 taken here), then, while
# BUDGET_S (180 s from the start of `run`: a session has 15 minutes of
# device time in all) leaves room:
# 1. tests/golden.rs's CUDA tests (float32 path against the 0.02-nats rule,
#    bf16 path against llama.cpp's gaps, chunking/prefix/batching
#    invariance) on the plain executor (120 s at most), then, with 60 s
#    left, with VELLUM_TP_COLLECTIVE=1 — the tensor-parallel path over an
#    NCCL group of one, the parallelism issue's single-GPU check;
# 2. the `spec` step with what is left: benchmarks/spec_decode.sh's
#    measurement through --device cuda on the joined file — `vellum bench
#    latency --batch-size 1 --output-len 128 --num-iters 2 --prompt …
#    --chat` on the four benchmarks/prompts/ workloads without speculation
#    and with the same n-gram SPEC, in ROUNDS (2) alternated rounds, and on
#    rewrite_code also with the file as its own draft model (`"method":
#    "draft_model"`: only proves the path and prices a draft as costly as
#    the target; DRAFT=0 leaves it out). JSON lines in $OUT/spec_cuda.jsonl,
#    the runs' logs in $OUT/spec_logs.tgz (after every run), and
#    benchmarks/spec_table.py's table of medians printed last.
# Everything printed also goes to $OUT/summary.txt as it runs. A run starts
# only while the budget leaves it 15 s; the rest print "SKIPPED (budget)".
# The spec step is 18 runs (start, load, 1 + 2 iterations of 128 tokens),
# 52 s in all on the 2-core CPU (`DEVICE=cpu`, 2.9 s a run); on a GPU it
# gets what the golden tests leave (BUDGET_S=540 in a call of its own runs
# it whole).
#
#   bash benchmarks/golden_gpu.sh spec      # the spec step alone; here on the
#                                           #   CPU with DEVICE=cpu
#                                           #   VELLUM=target/release/vellum
#                                           #   GGUF=~/.cache/vellum/<file>
#                                           #   (OUTPUT_LEN, ROUNDS, SPEC, DRAFT,
#                                           #   BUDGET_S as above)
set -uo pipefail
cd "$(dirname "$0")/.."
name=SmolLM2-135M-Instruct.Q4_1.gguf
t0=$SECONDS
budget=${BUDGET_S:-180}
. benchmarks/lib.sh  # stamp, fits, wait_up
# Everything printed from here on also in $1/summary.txt, as it comes.
summary() {
    exec > >(tee "$1/summary.txt") 2>&1
    tee_pid=$!
}
# Lets tee write the last lines to summary.txt before the script ends.
end_summary() {
    exec >&- 2>&-
    wait "$tee_pid" 2>/dev/null
}

# The spec step: `vellum bench latency` at one sequence on the four
# workloads, plainly, with n-gram prompt lookup (on a GPU also with its
# verification steps replayed as CUDA graphs), and (rewrite_code) with
# the model file as its own draft, in alternated rounds; each run's JSON
# tagged with its workload, mode and round in $out/spec_$device.jsonl, its
# log in $out/spec_logs.tgz; the table last.
spec_step() { # vellum device gguf out
    local vellum=$1 device=$2 gguf=$3 out=$4
    local rounds=${ROUNDS:-2} output_len=${OUTPUT_LEN:-128}
    local spec=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}
    # The draft model: the CLI takes a .gguf path (SpeculativeMethod::DraftModel).
    local draft="{\"method\": \"draft_model\", \"model\": \"$gguf\", \"num_speculative_tokens\": 4}"
    local runs=$out/spec_$device.jsonl logs round w mode modes extra tag left rc
    logs=$(mktemp -d)
    rm -f "$runs"
    touch "$runs"
    for round in $(seq 1 "$rounds"); do
        for w in rewrite_text rewrite_code fix_code chat; do
            modes="plain ngram"
            # On a GPU, n-gram again with the verification steps (mixed steps)
            # replayed as CUDA graphs (--compilation-config's FULL).
            [ "$device" = cuda ] && modes="$modes ngram_full"
            [ "$w" = rewrite_code ] && [ "${DRAFT:-1}" = 1 ] && modes="$modes draft_model"
            for mode in $modes; do
                # A run gets what the budget leaves, 60 s at most, 15 s at least.
                left=$((budget - (SECONDS - t0)))
                if [ "$left" -lt 15 ]; then
                    stamp "spec: SKIPPED (budget) from round $round, $w $mode on"
                    break 3
                fi
                [ "$left" -gt 60 ] && left=60
                extra=()
                [ "$mode" = ngram ] && extra=(--speculative-config "$spec")
                [ "$mode" = ngram_full ] && extra=(--speculative-config "$spec" --compilation-config '{"cudagraph_mode": "FULL"}')
                [ "$mode" = draft_model ] && extra=(--speculative-config "$draft")
                tag=${w}_${mode}_$round
                timeout "$left" "$vellum" bench latency --device "$device" --model "$gguf" --batch-size 1 \
                    --output-len "$output_len" --num-iters 2 --prompt "$(cat "benchmarks/prompts/$w.txt")" --chat --json \
                    "${extra[@]}" >"$logs/$tag.json" 2>"$logs/$tag.log"
                rc=$?
                python3 - "$logs/$tag.json" "$runs" "$w" "$mode" "$round" <<'PY' || { stamp "spec $tag: exit $rc"; tail -n 3 "$logs/$tag.log" | cut -c1-200; }
import json, sys
src, runs, w, mode, rnd = sys.argv[1:]
try:
    d = json.load(open(src))
except (OSError, ValueError):
    sys.exit(1)  # no report: the shell prints the exit status and the log's end
d.update(workload=w, mode=mode, round=int(rnd))
open(runs, "a").write(json.dumps(d) + "\n")
sd = d.get("spec_decode") or {}
acc = f", {100 * sd['acceptance_rate']:.1f}% accepted" if sd else ""
print(f"spec {w} {mode} round {rnd}: {d['decode_tokens_per_s']:.1f} tok/s{acc}")
PY
                tar -C "$logs" -czf "$out/spec_logs.tgz" . 2>/dev/null
            done
        done
    done
    stamp "spec: $(wc -l <"$runs") runs; medians (--device $device, $output_len tokens, SmolLM2-135M-Instruct Q4_1):"
    python3 benchmarks/spec_table.py --by-method "$runs"
}

case "${1:-}" in
split)
    src=${VELLUM_CACHE:-$HOME/.cache/vellum}/$name
    [ -f "$src" ] || { echo "no $src: run the README's first command once to download it" >&2; exit 1; }
    mkdir -p .gpu-golden
    # 40 MB beside .gpu and .gpu-llama (~20 MB) and the tree (~5 MB) in the
    # first call; the rest (58 MB) alone in the second.
    head -c 40000000 "$src" >.gpu-golden/a
    tail -c +40000001 "$src" >.gpu-golden/b
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
    summary "$out"
    # shellcheck disable=SC1091 # staged there
    source .gpu/run.sh env >/dev/null
    for mode in plain collective; do
        collective=0 limit=120
        [ "$mode" = collective ] && collective=1 limit=$((budget - (SECONDS - t0) - 15))
        if [ "$mode" = collective ] && [ "$limit" -lt 45 ]; then
            stamp "golden ($mode): SKIPPED (budget)"
            continue
        fi
        VELLUM_TP_COLLECTIVE=$collective timeout "$limit" .gpu/x/golden --test-threads 1 --nocapture cuda >"$out/golden_$mode.txt" 2>&1
        stamp "golden ($mode): exit $?"
        grep -E "^test |test result|agree|largest|SKIPPED|panicked" "$out/golden_$mode.txt" | cut -c1-200
    done
    spec_step .gpu/x/vellum "${DEVICE:-cuda}" ".gpu/models/$name" "$out"
    end_summary
    ;;
spec)
    out=${OUT:-.gpu/out}
    mkdir -p "$out"
    summary "$out"
    vellum=${VELLUM:-.gpu/x/vellum}
    if [ -z "${VELLUM:-}" ]; then
        # shellcheck disable=SC1091 # staged there
        source .gpu/run.sh env >/dev/null
    fi
    spec_step "$vellum" "${DEVICE:-cuda}" "${GGUF:-.gpu/models/$name}" "$out"
    end_summary
    ;;
*)
    echo "usage: $0 split|stash|run|spec" >&2
    exit 2
    ;;
esac
