# shellcheck shell=bash
# Source it (do not run it): `source scripts/deploy/node_env.sh`.
# Environment every Ray node of a vllm_dspark deployment needs. Sourced by
# ray_head.sh and ray_worker.sh BEFORE `ray start`: Ray actors (vLLM's workers)
# inherit the environment of the node's raylet, and vLLM does not copy per-node
# variables (VLLM_HOST_IP, CUDA_VISIBLE_DEVICES) from the driver.
#
# Required:  VLLM_HOST_IP   this node's address on the network the nodes share
# Optional:  NET_IF         that network's interface (default: the one holding VLLM_HOST_IP)
#            NCCL_IB_HCA    InfiniBand HCAs for NCCL (default: NCCL's own choice)

if [[ -z "${VLLM_HOST_IP:-}" ]]; then
  echo "node_env.sh: set VLLM_HOST_IP to this node's IP on the inter-node network, e.g." >&2
  echo "  export VLLM_HOST_IP=10.0.0.11" >&2
  return 1
fi
if ! ip -o -4 addr show | awk '{print $4}' | cut -d/ -f1 | grep -qx "$VLLM_HOST_IP"; then
  echo "node_env.sh: VLLM_HOST_IP=$VLLM_HOST_IP is not an address of this node (see: ip -4 addr)" >&2
  return 1
fi
NET_IF="${NET_IF:-$(ip -o -4 addr show | awk -v ip="$VLLM_HOST_IP" '{split($4, a, "/"); if (a[1] == ip) print $2}' | head -n1)}"
export VLLM_HOST_IP
# NCCL (GPU collectives) and Gloo (vLLM's CPU-side groups) must use the same network as Ray.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$NET_IF}"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NET_IF}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Kimi K3 with a GQA DSpark drafter needs the attention-residual stream capture in
# every process. The vllm_dspark plugin turns it on in the driver and vLLM copies it
# to Ray actors; exporting it here as well makes each node's setting visible. Never 0.
export VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1

# The plugin must be installed (not just importable) on every node: vLLM loads it in
# each Ray actor through the `vllm.general_plugins` entry point, and a Ray runtime_env
# upload does not carry entry points.
python - <<'PY' || { echo "node_env.sh: fix the installation above on this node first" >&2; return 1; }
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version
try:
    print(f"vllm {version('vllm')}, vllm_dspark {version('vllm_dspark')}, ray {version('ray')}")
except PackageNotFoundError as exc:
    sys.exit(f"node_env.sh: {exc.name} is not installed; see scripts/deploy/install_node.sh")
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "dspark"]
if not eps:
    sys.exit("node_env.sh: the vllm_dspark plugin entry point is missing; pip install the vllm_dspark "
             "package (a wheel or `pip install .`), not a PYTHONPATH copy")
print(f"plugin entry point: {eps[0].value}")
PY
echo "node_env.sh: VLLM_HOST_IP=$VLLM_HOST_IP NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME"
