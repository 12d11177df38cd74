#!/usr/bin/env bash
# Build llama.cpp's CPU tools (llama-bench, llama-server, llama-completion, llama-tokenize, llama-quantize) from
# the llama-cpp-python sdist into .cache/llama.cpp, for benchmarks and the verification script
# only: gmlx never links them. Cached: a second run with the binaries present does nothing.
# Niced and -j2 by default because the build machine is usually shared.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${LLAMA_CPP_CACHE:-.cache/llama.cpp}"
JOBS="${LLAMA_CPP_JOBS:-2}"
TOOLS=(llama-bench llama-server llama-completion llama-tokenize llama-quantize)
mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"

is_built() {
  for tool in "${TOOLS[@]}"; do [[ -x "$CACHE/bin/$tool" ]] || return 1; done
}
if is_built; then
  echo "llama.cpp tools already built in $CACHE/bin"
  exit 0
fi

if ! ls "$CACHE"/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    --dest "$CACHE/sdist" llama-cpp-python
fi
SDIST="$(ls "$CACHE"/sdist/llama_cpp_python-*.tar.gz | sort | tail -n 1)"
SRC="$CACHE/src"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  rm -rf "$SRC" "$CACHE/unpack"
  mkdir -p "$CACHE/unpack"
  tar -xzf "$SDIST" -C "$CACHE/unpack"
  mv "$CACHE"/unpack/llama_cpp_python-*/vendor/llama.cpp "$SRC"
  rm -rf "$CACHE/unpack"
fi

# CPU only, tuned to this machine; no curl (the tools only read local files here).
nice -n 19 cmake -S "$SRC" -B "$CACHE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
nice -n 19 cmake --build "$CACHE/build" -j "$JOBS" --target "${TOOLS[@]}"
mkdir -p "$CACHE/bin"
for tool in "${TOOLS[@]}"; do cp "$CACHE/build/bin/$tool" "$CACHE/bin/"; done
echo "llama.cpp tools built in $CACHE/bin (run them with --repack 0 / --no-repack where AMX kernels die)"
