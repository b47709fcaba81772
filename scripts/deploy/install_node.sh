#!/usr/bin/env bash
# Install what a GPU node of the deployment runs: vLLM (CUDA), Ray, and the vllm_dspark plugin.
# Run it on EVERY node (head and workers) with the same versions.
#
#   scripts/deploy/install_node.sh /path/to/vllm_dspark      # a checkout of this repository
#   scripts/deploy/install_node.sh /path/to/vllm_dspark-0.1.0-*.whl
set -euo pipefail
SRC="${1:?usage: install_node.sh PATH_TO_VLLM_DSPARK_CHECKOUT_OR_WHEEL}"
python -m pip install "vllm>=0.33.0,<0.34" "ray[default]==2.60.0"
# --no-build-isolation: build the plugin's op against the torch vLLM just installed.
python -m pip install --no-build-isolation "$SRC"
python - <<'PY'
from importlib.metadata import entry_points, version
assert any(e.name == "dspark" for e in entry_points(group="vllm.general_plugins")), "plugin entry point missing"
print(f"ok: vllm {version('vllm')}, ray {version('ray')}, vllm_dspark {version('vllm_dspark')}")
PY
