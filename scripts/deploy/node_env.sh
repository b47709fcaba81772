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
# Ray: token authentication, and a fixed port for every Ray listener so that the firewall rule
# of docs/deployment.md ("Which ports are open") can name them. Ray 2.60 binds the GCS, the
# raylet's two ports, every worker's port and the metrics endpoints to ALL interfaces whatever
# the options (tests/deploy/test_ray_listeners.py shows it): only that firewall rule keeps them
# on the cluster network.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" ]]; then
  RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
  if [[ ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
    echo "node_env.sh: Ray token authentication is on but $RAY_AUTH_TOKEN_PATH is missing. On the head," >&2
    echo "  run \`ray get-auth-token --generate\`, then copy ~/.ray/auth_token to every node and client" >&2
    echo "  (or export RAY_AUTH_TOKEN_PATH=<the shared file>)" >&2
    return 1
  fi
  export RAY_AUTH_TOKEN_PATH
fi
export RAY_PORT="${RAY_PORT:-6379}"                  # GCS (head only)
export AUTOSCALER_METRIC_PORT="${AUTOSCALER_METRIC_PORT:-44217}"  # read by Ray's autoscaler (head)
export DASHBOARD_METRIC_PORT="${DASHBOARD_METRIC_PORT:-44227}"    # read by Ray's dashboard (head)
export VLLM_PORT="${VLLM_PORT:-29500}"              # vLLM's torch.distributed store: VLLM_PORT and up
# shellcheck disable=SC2034  # used by ray_head.sh / ray_worker.sh
RAY_NODE_PORT_ARGS=(
  --node-ip-address "$VLLM_HOST_IP"
  --node-manager-port "${RAY_NODE_MANAGER_PORT:-6380}"
  --object-manager-port "${RAY_OBJECT_MANAGER_PORT:-6381}"
  --runtime-env-agent-port "${RAY_RUNTIME_ENV_AGENT_PORT:-6382}"
  --dashboard-agent-grpc-port "${RAY_DASHBOARD_AGENT_GRPC_PORT:-6383}"
  --dashboard-agent-listen-port "${RAY_DASHBOARD_AGENT_LISTEN_PORT:-52365}"
  --metrics-export-port "${RAY_METRICS_EXPORT_PORT:-6384}"
  --min-worker-port "${RAY_MIN_WORKER_PORT:-10002}"
  --max-worker-port "${RAY_MAX_WORKER_PORT:-10999}"
)

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
echo "node_env.sh: VLLM_HOST_IP=$VLLM_HOST_IP NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME RAY_AUTH_MODE=$RAY_AUTH_MODE"
