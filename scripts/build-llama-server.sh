#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench from the llama.cpp that the llama-cpp-python sdist
# carries (the same code llmd runs), for the remote-model tests and the benchmarks that compare with
# it. About 10 minutes on two cores the first time; cached under ~/.cache/llmd-peers afterwards.
# Prints the folder holding the binaries. On CPUs with AMX run llama-server with --no-repack.
set -euo pipefail
VERSION=${1:-0.3.36}
OUT=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/llmd-peers/llama.cpp-$VERSION}
BIN=$OUT/build/bin
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --no-deps --no-binary :all: -q -d "$work" "llama-cpp-python==$VERSION" >&2
tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
cp -a "$work"/llama_cpp_python-"$VERSION"/vendor/llama.cpp/. "$OUT"/
cmake -S "$OUT" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$OUT/build" --target llama-server llama-bench -j"$(nproc)" >&2
echo "$BIN"
