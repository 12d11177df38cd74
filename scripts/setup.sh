#!/usr/bin/env bash
# Everything a fresh machine needs: the system BLAS (Linux, where apt is usable), then
# this package with its test extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_system_deps.sh
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
