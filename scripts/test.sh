#!/usr/bin/env bash
# Runs the test suite on the CPU (torch_xla included, through PJRT_DEVICE=CPU),
# installing everything first if needed. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PJRT_DEVICE=CPU
exec .venv/bin/python -m pytest -q "$@"
