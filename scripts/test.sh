#!/usr/bin/env bash
# Runs the test suite on the CPU (torch_xla included, through PJRT_DEVICE=CPU),
# installing everything first if needed. Extra arguments go to pytest.
# The test files are shared out among one worker process per core (pytest-xdist,
# a file's tests together and in order); each worker's torch uses one thread, as
# runs that share cores should. One process instead: scripts/test.sh -n 0.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PJRT_DEVICE=CPU
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -n auto --dist loadfile "$@"
