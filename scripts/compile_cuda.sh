#!/usr/bin/env bash
# Compile every csrc/*.cu for Ampere, Hopper, Blackwell and consumer Blackwell
# (sm_80, sm_90, sm_100, sm_120) so the CUDA kernels cannot rot on machines
# without a GPU or a CUDA torch (CI runs this). Same half/bf16 flags as torch's
# extension builds, warnings are errors, and the build fails when ptxas reports
# a spill, a stack frame or local memory for any kernel (parsed from -Xptxas -v);
# it prints every kernel's registers per thread for each architecture.
# The .cu files include no torch headers; the torch glue (csrc/*_cuda.cpp) is
# built only by `pip install` with a CUDA torch.
# Usage: scripts/compile_cuda.sh [extra nvcc flags...]; NVCC overrides the
# compiler, ARCHS (e.g. "90") the architectures.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc="${NVCC:-nvcc}"
if ! command -v "$nvcc" >/dev/null 2>&1; then
  echo "compile_cuda.sh: $nvcc not found" >&2
  exit 2
fi
# Fast math would change the scores the op promises to reproduce exactly
# (approximate division and logf, flushed subnormals). nvcc 13 defines no macro
# for it, so the source's `#error` on __USE_FAST_MATH__ only fires with
# toolkits that do; the flags are refused here, and the score path uses
# non-.ftz PTX rounding ops that no flag can change (markov_common.h).
for a in "$@"; do
  case "$a" in
    --use_fast_math|-use_fast_math|--use-fast-math|-ftz=true|--ftz=true|-ftz=1|\
    -prec-div=false|--prec-div=false|-prec-sqrt=false|--prec-sqrt=false)
      echo "compile_cuda.sh: markov_draft_kernels.cu must not be built with --use_fast_math" \
           "(or $a): the op promises the reference's exact fp32 scores" >&2
      exit 1 ;;
  esac
done
archs="${ARCHS:-80 90 100 120}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
shopt -s nullglob
sources=("$root"/csrc/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "compile_cuda.sh: no .cu sources in csrc/" >&2
  exit 1
fi
gencode=()
for a in $archs; do gencode+=(-gencode "arch=compute_${a},code=sm_${a}"); done
torch_flags=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
             -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
status=0
for src in "${sources[@]}"; do
  name="$(basename "${src%.cu}")"
  echo "nvcc -c ${name}.cu for sm_${archs// /, sm_}"
  log="$out/$name.log"
  if ! "$nvcc" -c "${gencode[@]}" -O3 -std=c++17 --expt-relaxed-constexpr --threads 0 \
      -Werror all-warnings "${torch_flags[@]}" -Xptxas -v -I"$root/csrc" "$@" \
      -o "$out/$name.o" "$src" >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
  fi
  # ptxas -v: "N bytes stack frame, N bytes spill stores, N bytes spill loads"
  # (and "N bytes lmem" on older toolkits). Any non-zero count fails the build.
  bad="$(grep -E '[1-9][0-9]* bytes (stack frame|spill stores|spill loads|lmem)' "$log" || true)"
  if [ -n "$bad" ]; then
    echo "compile_cuda.sh: ptxas reports spills or local memory in $name.cu:" >&2
    grep -E "Compiling entry|Function properties|bytes (stack frame|spill|lmem)" "$log" \
      | grep -B2 -E '[1-9][0-9]* bytes (stack frame|spill stores|spill loads|lmem)' >&2 || true
    status=1
  fi
  kernels="$(grep -c 'Compiling entry function' "$log" || true)"
  if [ -z "$bad" ]; then echo "  ${kernels} kernel compilations, no spills or local memory"; fi
  # Registers per thread of every kernel and architecture ("Used N registers"),
  # demangled when c++filt is there.
  demangle=cat
  if command -v c++filt >/dev/null 2>&1; then demangle=c++filt; fi
  echo "  registers per thread (sm_${archs// /, sm_}):"
  sed -nE "s/.*Compiling entry function '([^']+)' for 'sm_([0-9]+)'.*/K \1 \2/p;
           s/.*Used ([0-9]+) registers.*/R \1/p" "$log" \
    | awk -v archs="$archs" '
        $1 == "K" { k = $2; a = $3; if (!(k in seen)) { seen[k] = 1; order[n++] = k }; next }
        $1 == "R" { regs[k, a] = $2 }
        END {
          na = split(archs, as, " ")
          for (i = 0; i < n; i++) {
            line = order[i] " "
            for (j = 1; j <= na; j++) line = line " " ((order[i], as[j]) in regs ? regs[order[i], as[j]] : "-")
            print line
          }
        }' \
    | "$demangle" \
    | sed -E 's/^void //; s/dspark::\(anonymous namespace\):://g; s/dspark:://g; s/\([^()]*\)//' \
    | sort | awk '{ name = $1; $1 = ""; printf "    %-34s%s\n", name, $0 }'
done
if [ "$status" -ne 0 ]; then exit "$status"; fi
echo "compiled ${#sources[@]} CUDA source(s) for sm_${archs// /, sm_}"
