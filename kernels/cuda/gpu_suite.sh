#!/usr/bin/env bash
# The CUDA GPU suite (crates/backend-cuda/tests/gpu.rs) as one command on a
# machine that has an NVIDIA GPU and a driver but no Rust and no network.
#
#   kernels/cuda/gpu_suite.sh stage   # here: builds the test binary into .gpu/
#   bash .gpu/run.sh                  # there, with .gpu/ copied over (the device
#                                     # tool: carry [".gpu"], command "bash .gpu/run.sh")
#
# The kernels compile on the GPU machine with its own NVRTC (a CUDA toolkit's
# libnvrtc.so; set NVRTC_DIR to its directory if it is not on the loader path).
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
stage)
    bin=$(cargo test -p vellum-backend-cuda --release --locked --test gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
    mkdir -p .gpu
    # Without debug info: the device tool carries at most 64 MiB.
    strip --strip-debug -o .gpu/gpu_suite "$bin" 2>/dev/null || cp "$bin" .gpu/gpu_suite
    cat >.gpu/run.sh <<'RUN'
#!/usr/bin/env bash
# Runs the CUDA GPU suite; every test must find the GPU (VELLUM_REQUIRE_GPU).
here=$(cd "$(dirname "$0")" && pwd)
for d in "${NVRTC_DIR:-}" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -n "$d" ] && [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
VELLUM_REQUIRE_GPU=1 exec "$here/gpu_suite" --test-threads 1 --nocapture
RUN
    echo "staged $(du -h .gpu/gpu_suite | cut -f1) in .gpu/: run it there with bash .gpu/run.sh"
    ;;
*)
    echo "usage: $0 stage" >&2
    exit 2
    ;;
esac
