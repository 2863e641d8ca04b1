#!/usr/bin/env bash
# Compile every csrc/*.cu to an object file for sm_80 and sm_90a with nvcc alone (no torch headers:
# the kernels are plain CUDA translation units with extern "C" launchers; the torch binding in
# csrc/bindings.cpp is built only by setup.py / CMake where a CUDA build of torch exists).
# Usage: .ci/compile_cuda.sh [out_dir]   (NVCC=/path/to/nvcc to pick a compiler)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/build/cuda_objects}"
nvcc="${NVCC:-nvcc}"
mkdir -p "$out"
shopt -s nullglob
sources=("$root"/csrc/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "no .cu files under csrc/" >&2
  exit 1
fi
for src in "${sources[@]}"; do
  name="$(basename "$src" .cu)"
  echo "nvcc $name.cu -> $out/$name.o (sm_80, sm_90a)"
  "$nvcc" -c "$src" -o "$out/$name.o" -std=c++17 -O3 -Xcompiler -Wall -Werror all-warnings \
    -I "$root/csrc" \
    -gencode arch=compute_80,code=sm_80 \
    -gencode arch=compute_90a,code=sm_90a
done
echo "compiled ${#sources[@]} CUDA translation units"
