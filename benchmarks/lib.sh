# shellcheck shell=bash disable=SC2154 # t0 and budget are the callers'
# Shell helpers the benchmarks share: `. benchmarks/lib.sh`.

# Waits until `$1/health` answers 200, polling four times a second, for at
# most $2 seconds (default 300); fails otherwise. Python's urllib, not curl:
# the GPU machines have no curl.
wait_up() {  # url [seconds]
    for _ in $(seq 1 $((4 * ${2:-300}))); do
        python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=1)" "$1" 2>/dev/null && return 0
        sleep 0.25
    done
    echo "server at $1 did not come up" >&2
    return 1
}

# The GPU scripts' time budget: `t0` (their start, in $SECONDS) and `budget`
# (seconds) set before these are called.
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
# Whether $1 more seconds fit in the budget.
fits() { [ $((SECONDS - t0 + $1)) -le "$budget" ]; }
