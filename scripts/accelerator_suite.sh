#!/bin/sh
exec "$(dirname "$0")/../.venv/bin/python" "$(dirname "$0")/../benchmarks/accelerator_suite.py" "$@"
