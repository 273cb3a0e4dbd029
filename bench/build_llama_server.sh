#!/usr/bin/env bash
# The llama-server the comparison benches run (bench/RESULTS.md names its version): llama.cpp
# as vendored in the llama-cpp-python source package of LLAMA_CPP_PYTHON, built for this CPU
# (GGML_NATIVE) into .cache/llama-server/. Needs the package index, cmake and a C++ compiler;
# about 15 minutes on two cores. Prints the binary's path.
set -euo pipefail
version=${LLAMA_CPP_PYTHON:-0.3.36}
root=$(cd "$(dirname "$0")/.." && pwd)/.cache/llama-server
bin=$root/llama-cpp-python-$version/vendor/llama.cpp/build/bin/llama-server
if [ ! -x "$bin" ]; then
  mkdir -p "$root"
  python3 -m pip download --quiet --no-deps --no-binary :all: -d "$root" \
    "llama-cpp-python==$version" >&2
  tar xzf "$root/llama_cpp_python-$version.tar.gz" -C "$root"
  rm -rf "$root/llama-cpp-python-$version"
  mv "$root/llama_cpp_python-$version" "$root/llama-cpp-python-$version"
  src=$root/llama-cpp-python-$version/vendor/llama.cpp
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
  cmake --build "$src/build" --target llama-server -j "$(nproc)" >&2
fi
echo "$bin"
