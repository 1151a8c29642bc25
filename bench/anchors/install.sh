#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
#
# The anchors for bench/anchors/anchors.py, under build/anchors/ (not part of the build or CI):
#   build/anchors/kt/        a venv with kt-kernel 0.7.2 (it pins torch 2.9.1: a venv of its own)
#   build/anchors/llama/     llama-cpp-python 0.3.36's source (the llama.cpp it vendors) and
#                            its ggml built alone (static, GGML_NATIVE=ON)
#   build/anchors/ggml_moe   ggml_moe.cpp linked against that ggml
# Each step is skipped when its result is there. PYTHON=python3.11 by default (kt-kernel's
# wheels are built for CPython 3.10-3.12).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${ANCHORS_DIR:-$root/build/anchors}"
python="${PYTHON:-python3.11}"
kt_version=0.7.2
llama_version=0.3.36
mkdir -p "$out"

if [ ! -x "$out/kt/bin/python" ] || ! "$out/kt/bin/python" -c "import kt_kernel" 2>/dev/null; then
  "$python" -m venv "$out/kt"
  "$out/kt/bin/pip" install --quiet "kt-kernel==$kt_version"
fi
echo "kt-kernel: $("$out/kt/bin/python" -c 'import kt_kernel as k; print(k.__version__, k.__cpu_variant__)' 2>/dev/null | tail -1)"

src="$out/llama/llama_cpp_python-$llama_version"
if [ ! -d "$src/vendor/llama.cpp/ggml" ]; then
  mkdir -p "$out/llama"
  "$python" -m pip download --quiet --no-deps --no-binary :all: -d "$out/llama" \
    "llama-cpp-python==$llama_version"
  tar -xzf "$out/llama/llama_cpp_python-$llama_version.tar.gz" -C "$out/llama"
fi
ggml="$src/vendor/llama.cpp/ggml"
touch "$ggml/ggml.pc.in"  # the sdist leaves it out; ggml's CMakeLists configures it
if [ ! -f "$out/llama/build/src/libggml-cpu.a" ]; then
  # llama.cpp's defaults for a CPU build: native ISA, llamafile's sgemm, OpenMP, repack on.
  cmake -S "$ggml" -B "$out/llama/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_LLAMAFILE=ON -DGGML_OPENMP=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF >/dev/null
  nice -n 10 cmake --build "$out/llama/build" -j"${JOBS:-2}" >/dev/null
fi
if [ ! -x "$out/ggml_moe" ] || [ "$here/ggml_moe.cpp" -nt "$out/ggml_moe" ]; then
  b="$out/llama/build/src"
  nice -n 10 "${CXX:-g++}" -O2 -std=c++17 -march=native -I"$ggml/include" "$here/ggml_moe.cpp" \
    -o "$out/ggml_moe" "$b/libggml.a" "$b/libggml-cpu.a" "$b/libggml-base.a" -fopenmp -lpthread -ldl
fi
echo "ggml_moe: $out/ggml_moe (ggml of llama-cpp-python $llama_version)"
