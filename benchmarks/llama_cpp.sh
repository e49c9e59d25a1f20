#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-batched-bench, llama-server) from the
# tree vendored in the llama-cpp-python 0.3.36 sdist, once, into
# benchmarks/.llama.cpp, and prints the directory of the binaries.
#
# Needs cmake (`apt-get install cmake`) and a C++ compiler; ~15 minutes on
# 2 cores. The sdist is fetched with `pip download --no-binary` for that
# package only (its build backend comes as wheels: no cmake from source).
# LLAMA_CPP_BIN=/dir skips all of this.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${LLAMA_CPP_BIN:-}" ]; then echo "$LLAMA_CPP_BIN"; exit 0; fi
ROOT=benchmarks/.llama.cpp
BIN=$ROOT/src/vendor/llama.cpp/build/bin
# EXTRA_TARGETS: more of its tools (benchmarks/accuracy.sh: llama-perplexity llama-quantize).
TARGETS="llama-batched-bench llama-server ${EXTRA_TARGETS:-}"
missing=""
for t in $TARGETS; do [ -x "$BIN/$t" ] || missing="$missing $t"; done
if [ -z "$missing" ]; then echo "$BIN"; exit 0; fi
command -v cmake >/dev/null || { echo "cmake is needed: apt-get install cmake" >&2; exit 1; }
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src" ]; then
    echo "== fetching the llama-cpp-python 0.3.36 sdist (llama.cpp vendored)" >&2
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==0.3.36" -d "$ROOT" >&2
    tar -xzf "$ROOT/llama_cpp_python-0.3.36.tar.gz" -C "$ROOT"
    mv "$ROOT/llama_cpp_python-0.3.36" "$ROOT/src"
fi
echo "== building $TARGETS (native CPU features)" >&2
# On CPUs with AMX, -march=native turns on ggml's AMX matmul, which
# segfaults at the first matmul of both benchmark models here (2026-11-25,
# a Xeon with amx_int8; the tile permission is granted): the known, unfixed
# ggml-org/llama.cpp#20824. The peer is then built without AMX, keeping
# AVX-512 VNNI and weight repacking: its fastest configuration that runs.
NO_AMX=()
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    echo "== this CPU has AMX: building without it (llama.cpp#20824)" >&2
    NO_AMX=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
cmake -S "$ROOT/src/vendor/llama.cpp" -B "$ROOT/src/vendor/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF "${NO_AMX[@]}" >&2
# shellcheck disable=SC2086
cmake --build "$ROOT/src/vendor/llama.cpp/build" -j"$(nproc)" --target $TARGETS >&2
echo "$BIN"
