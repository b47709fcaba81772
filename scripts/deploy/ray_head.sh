#!/usr/bin/env bash
# Start the Ray head on the first GPU node.
#
#   export VLLM_HOST_IP=10.0.0.11          # this node, on the network the nodes share
#   scripts/deploy/ray_head.sh             # then ray_worker.sh on the other nodes
#
# Optional: RAY_PORT (default 6379), NUM_GPUS (default: all GPUs nvidia-smi lists), RAY_CLIENT_SERVER_PORT
# (10001), and the per-node ports of node_env.sh. Token authentication is on (node_env.sh). The
# dashboard listens on 127.0.0.1 only (ssh -L 8265:127.0.0.1:8265 to see it). Apply the firewall
# rule of docs/deployment.md ("Which ports are open") on every node.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=node_env.sh
source "$HERE/node_env.sh"
RAY_PORT="${RAY_PORT:-6379}"
NUM_GPUS="${NUM_GPUS:-$(nvidia-smi -L | wc -l)}"
ray start --head \
  "${RAY_NODE_PORT_ARGS[@]}" \
  --port "$RAY_PORT" \
  --ray-client-server-port "${RAY_CLIENT_SERVER_PORT:-10001}" \
  --num-gpus "$NUM_GPUS" \
  --dashboard-host 127.0.0.1 \
  --disable-usage-stats
echo "ray_head.sh: head at $VLLM_HOST_IP:$RAY_PORT; on each other node run:"
echo "  export VLLM_HOST_IP=<that node's IP>; scripts/deploy/ray_worker.sh $VLLM_HOST_IP:$RAY_PORT"
