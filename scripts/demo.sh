#!/usr/bin/env bash
# Set up, serve the built-in model with its MTP drafter, stream one generation, shut down.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ADDRESS="${GMLX_DEMO_ADDRESS:-tcp://127.0.0.1:5555}"
LOG="$(mktemp)"
gmlx serve --drafter mtp --address "$ADDRESS" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 1 600); do
  grep -q "ready" "$LOG" && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.2
done
grep -q "ready" "$LOG" || { echo "server did not become ready"; cat "$LOG"; exit 1; }
gmlx generate --server "$ADDRESS" --max-tokens 120 "${1:-def parse_args(argv):}"
