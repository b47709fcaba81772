#!/usr/bin/env bash
# Serve Kimi K3 with the DSpark drafter through vLLM's Ray executor.
#
#   VLLM_API_KEY=... scripts/deploy/serve_k3.sh tp8      TARGET DRAFT   # one node, 8 GPUs
#   VLLM_API_KEY=... scripts/deploy/serve_k3.sh tp8pp2   TARGET DRAFT   # two nodes x 8 GPUs, pipeline over nodes
#
# TARGET: moonshotai/Kimi-K3 or a local copy; DRAFT: the DSpark checkpoint directory.
# Run on the Ray head node after ray_head.sh (and ray_worker.sh on the second node for
# tp8pp2), in a shell where VLLM_HOST_IP is exported as for ray_head.sh.
#
# API key (required): every /v1 request must carry "Authorization: Bearer KEY". The key comes
# from VLLM_API_KEY (preferred: it stays out of the process list) or --api-key KEY; vLLM reads
# it from VLLM_API_KEY. An open server (no key: anyone who reaches HOST:PORT can use it) must be
# asked for explicitly: --open or ALLOW_OPEN=1.
# Optional: HOST (default: VLLM_HOST_IP; the API listens there only), PORT (default 8000), NUM_SPEC
#           (default 7), MAX_MODEL_LEN (default: the model's),
#           EXTRA_ARGS (more `vllm serve` flags),
#           DRY_RUN=1 (run the checks, print the `vllm serve` command, do not start it).
set -euo pipefail
USAGE="usage: serve_k3.sh [--api-key KEY | --open] tp8|tp8pp2 TARGET DRAFT"
OPEN="${ALLOW_OPEN:-0}"
POSITIONAL=()
while (($#)); do
  case "$1" in
    --api-key) [[ $# -ge 2 && -n "$2" ]] || { echo "serve_k3.sh: --api-key needs a value; $USAGE" >&2; exit 2; }
               export VLLM_API_KEY="$2"; shift 2 ;;
    --api-key=*) export VLLM_API_KEY="${1#--api-key=}"; shift ;;
    --open) OPEN=1; shift ;;
    -h|--help) echo "$USAGE"; exit 0 ;;
    --) shift; POSITIONAL+=("$@"); break ;;
    -*) echo "serve_k3.sh: unknown option '$1'; $USAGE" >&2; exit 2 ;;
    *) POSITIONAL+=("$1"); shift ;;
  esac
done
set -- "${POSITIONAL[@]+"${POSITIONAL[@]}"}"
MODE="${1:?$USAGE}"
TARGET="${2:?$USAGE}"
DRAFT="${3:?$USAGE}"
case "$OPEN" in
  0|"") OPEN=0 ;;
  1) ;;
  *) echo "serve_k3.sh: ALLOW_OPEN must be 1 (serve without a key) or 0, got '$OPEN'" >&2; exit 2 ;;
esac
if [[ -n "${VLLM_API_KEY:-}" ]]; then
  if [[ "$OPEN" == 1 ]]; then
    echo "serve_k3.sh: an API key is set and --open / ALLOW_OPEN=1 asks for no key; choose one" >&2; exit 2
  fi
  AUTH_NOTE="API key required: every /v1 request needs 'Authorization: Bearer <VLLM_API_KEY>'"
elif [[ "$OPEN" == 1 ]]; then
  AUTH_NOTE="WARNING: no API key (--open / ALLOW_OPEN=1): anyone who can reach the API port can use this server"
else
  echo "serve_k3.sh: refusing to start an OpenAI server without an API key. Set VLLM_API_KEY (or pass" >&2
  echo "  --api-key KEY; e.g. export VLLM_API_KEY=\$(openssl rand -hex 32)), or pass --open (ALLOW_OPEN=1)" >&2
  echo "  to serve without one, to anyone who can reach the port." >&2
  exit 2
fi
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

# The speculative config is built by a JSON library: any draft path (quotes, backslashes) is
# one valid JSON string, and NUM_SPEC must be an integer.
SPEC_CONFIG="$(python - "$DRAFT" "$NUM_SPEC" <<'PY'
import json
import sys

draft, num_spec = sys.argv[1], sys.argv[2]
try:
    n = int(num_spec)
except ValueError:
    sys.exit(f"serve_k3.sh: NUM_SPEC must be an integer, got {num_spec!r}")
print(json.dumps({"method": "dspark", "model": draft, "num_speculative_tokens": n}))
PY
)"
# shellcheck disable=SC2206  # EXTRA_ARGS is a list of flags, split on spaces
CMD=(vllm serve "$TARGET"
  "${PARALLEL[@]}"
  --distributed-executor-backend ray
  --speculative-config "$SPEC_CONFIG"
  --trust-remote-code
  --host "$HOST"
  --port "$PORT"
  ${MAX_MODEL_LEN:+--max-model-len "$MAX_MODEL_LEN"}
  ${EXTRA_ARGS:-})
echo "serve_k3.sh: $AUTH_NOTE; listening on $HOST:$PORT" >&2
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "serve_k3.sh: DRY_RUN=1, not starting; the command is:" >&2
  printf '%q ' "${CMD[@]}"
  printf '\n'
  exit 0
fi
set -x  # the key is in VLLM_API_KEY, not on the command line, so the trace does not show it
exec "${CMD[@]}"
