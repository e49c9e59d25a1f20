# Shell helpers the server benchmarks share: `. benchmarks/lib.sh`.

# Waits until `$1/health` answers 200 (at most 300 s); fails otherwise.
wait_up() {  # url
    for _ in $(seq 1 300); do
        curl -sf "$1/health" >/dev/null 2>&1 && return 0
        sleep 1
    done
    echo "server at $1 did not come up" >&2
    return 1
}
