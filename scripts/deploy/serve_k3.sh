#!/usr/bin/env bash
# Serve Kimi K3 with the DSpark drafter through vLLM's Ray executor.
#
#   scripts/deploy/serve_k3.sh tp8      TARGET DRAFT   # one node, 8 GPUs
#   scripts/deploy/serve_k3.sh tp8pp2   TARGET DRAFT   # two nodes x 8 GPUs, pipeline over nodes
#
# TARGET: moonshotai/Kimi-K3 or a local copy; DRAFT: the DSpark checkpoint directory.
# Run on the Ray head node after ray_head.sh (and ray_worker.sh on the second node for
# tp8pp2), in a shell where VLLM_HOST_IP is exported as for ray_head.sh.
# Optional: HOST (default: VLLM_HOST_IP; the API listens there only), PORT (default 8000), NUM_SPEC
#           (default 7), MAX_MODEL_LEN (default: the model's),
#           EXTRA_ARGS (more `vllm serve` flags).
set -euo pipefail
MODE="${1:?usage: serve_k3.sh tp8|tp8pp2 TARGET DRAFT}"
TARGET="${2:?usage: serve_k3.sh tp8|tp8pp2 TARGET DRAFT}"
DRAFT="${3:?usage: serve_k3.sh tp8|tp8pp2 TARGET DRAFT}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=node_env.sh
source "$HERE/node_env.sh"
case "$MODE" in
  tp8)    PARALLEL=(--tensor-parallel-size 8); TP=8; PP=1 ;;
  tp8pp2) PARALLEL=(--tensor-parallel-size 8 --pipeline-parallel-size 2); TP=8; PP=2 ;;
  *) echo "serve_k3.sh: mode must be tp8 or tp8pp2, got '$MODE'" >&2; exit 2 ;;
esac
NUM_SPEC="${NUM_SPEC:-7}"
HOST="${HOST:-$VLLM_HOST_IP}"
PORT="${PORT:-8000}"
export RAY_ADDRESS="${RAY_ADDRESS:-$VLLM_HOST_IP:${RAY_PORT:-6379}}"

# Preflight: does the drafter fit the target (hidden size, vocabulary, layer ids under
# vLLM's aux-index convention, K3 residual-stream switch)? And what memory will it take?
TARGET_CONFIG="$TARGET"
if [[ ! -e "$TARGET/config.json" ]]; then
  TARGET_CONFIG="$(python -c 'import sys; from huggingface_hub import hf_hub_download as d; print(d(sys.argv[1], "config.json"))' "$TARGET")"
fi
vllm-dspark inspect "$DRAFT" --target "$TARGET_CONFIG" --no-scan
vllm-dspark plan --draft "$DRAFT" --target "$TARGET_CONFIG" --tp "$TP" --pp "$PP" \
  --num-speculative-tokens "$NUM_SPEC" ${MAX_MODEL_LEN:+--context "$MAX_MODEL_LEN"}

SPEC_CONFIG="{\"method\": \"dspark\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": $NUM_SPEC}"
set -x
# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
exec vllm serve "$TARGET" \
  "${PARALLEL[@]}" \
  --distributed-executor-backend ray \
  --speculative-config "$SPEC_CONFIG" \
  --trust-remote-code \
  --host "$HOST" \
  --port "$PORT" \
  ${MAX_MODEL_LEN:+--max-model-len "$MAX_MODEL_LEN"} \
  ${EXTRA_ARGS:-}
