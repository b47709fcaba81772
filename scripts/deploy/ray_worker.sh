#!/usr/bin/env bash
# Join a GPU node to the Ray cluster started by ray_head.sh.
#
#   export VLLM_HOST_IP=10.0.0.12          # THIS node, on the network the nodes share
#   scripts/deploy/ray_worker.sh 10.0.0.11:6379
#
# Optional: NUM_GPUS (default: all GPUs nvidia-smi lists), and the per-node ports of node_env.sh.
# Use the head's Ray token (node_env.sh) and apply the firewall rule of docs/deployment.md.
set -euo pipefail
HEAD="${1:?usage: ray_worker.sh HEAD_IP:PORT}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=node_env.sh
source "$HERE/node_env.sh"
NUM_GPUS="${NUM_GPUS:-$(nvidia-smi -L | wc -l)}"
ray start --address "$HEAD" \
  "${RAY_NODE_PORT_ARGS[@]}" \
  --num-gpus "$NUM_GPUS" \
  --disable-usage-stats
ray status --address "$HEAD"
