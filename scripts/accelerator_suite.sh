#!/bin/sh
exec "$(dirname "$0")/../.venv/bin/python" "$(dirname "$0")/../benchmarks/accelerators/accelerator_suite.py" "$@"
