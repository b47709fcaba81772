#!/usr/bin/env bash
# Compile every csrc/*.cu to an object file for Hopper (sm_90) so the CUDA
# kernels cannot rot on machines without a GPU or a CUDA torch (CI runs this).
# The .cu files include no torch headers; the torch glue (csrc/*_cuda.cpp) is
# built only by `pip install` with a CUDA torch.
# Usage: scripts/compile_cuda.sh [extra nvcc flags...]; NVCC overrides the compiler.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc="${NVCC:-nvcc}"
if ! command -v "$nvcc" >/dev/null 2>&1; then
  echo "compile_cuda.sh: $nvcc not found" >&2
  exit 2
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
shopt -s nullglob
sources=("$root"/csrc/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "compile_cuda.sh: no .cu sources in csrc/" >&2
  exit 1
fi
for src in "${sources[@]}"; do
  obj="$out/$(basename "${src%.cu}").o"
  echo "nvcc -c -arch=sm_90 $(basename "$src")"
  "$nvcc" -c -arch=sm_90 -O3 -std=c++17 --expt-relaxed-constexpr -Werror all-warnings \
    -I"$root/csrc" "$@" -o "$obj" "$src"
done
echo "compiled ${#sources[@]} CUDA source(s) for sm_90"
