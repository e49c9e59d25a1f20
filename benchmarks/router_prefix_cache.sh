#!/usr/bin/env bash
# Replicas behind an existing router: REPLICAS `vellum serve` processes of
# the default model behind `sglang-router` (PyPI, the version .ci/run pins),
# the shared-prefix chat workload of benchmarks/router_client.py, once with
# the router's cache-aware policy and once with round robin (fresh replicas
# for each, so that both start with empty prefix caches). Prints one JSON
# line per policy: the replicas' prefix-cache hit rate (from their
# /metrics) and the client's time to first token.
#
#   python3 -m pip install sglang-router==0.3.2 && benchmarks/router_prefix_cache.sh
set -euo pipefail
cd "$(dirname "$0")/.."

REPLICAS=${REPLICAS:-3}
REQUESTS=${REQUESTS:-192}
CONCURRENCY=${CONCURRENCY:-6}
# 24 system prompts of ~500 tokens against 96 MiB of KV per replica (room
# for about 8 of them at 23 KB a token): a replica cannot keep every prefix,
# so where a request lands decides whether its prefix is cached.
PREFIXES=${PREFIXES:-24}
KV=${KV:-96MiB}
OUT=${OUT:-target/bench-router}
VELLUM=target/release/vellum
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
cargo build --release -p vellum-server
"$PYTHON" -c "import sglang_router" || { echo "sglang-router is needed: $PYTHON -m pip install sglang-router==0.3.2" >&2; exit 1; }

. benchmarks/lib.sh  # wait_up

run() {  # policy
    local pids=() urls=()
    for i in $(seq 1 "$REPLICAS"); do
        local port=$((8310 + i))
        RAYON_NUM_THREADS=1 "$VELLUM" serve --port "$port" --kv-cache-memory "$KV" --max-model-len 2048 \
            > "$OUT/replica-$1-$i.log" 2>&1 &
        pids+=($!)
        urls+=("http://127.0.0.1:$port")
    done
    for u in "${urls[@]}"; do wait_up "$u"; done
    "$PYTHON" -m sglang_router.launch_router --worker-urls "${urls[@]}" --policy "$1" --port 8310 \
        --prometheus-port 8319 > "$OUT/router-$1.log" 2>&1 &
    pids+=($!)
    wait_up http://127.0.0.1:8310
    sleep 2  # the router registers its workers
    "$PYTHON" benchmarks/router_client.py http://127.0.0.1:8310 "$1" "${urls[@]}" \
        --requests "$REQUESTS" --concurrency "$CONCURRENCY" --prefixes "$PREFIXES" | tee -a "$OUT/results.jsonl"
    kill "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
}

run cache_aware
run round_robin
