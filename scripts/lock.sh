#!/usr/bin/env bash
# Refreshes requirements.lock: every runtime and dev dependency of
# octfw[xla,dev], pinned with hashes, for CPython 3.11 on x86-64 Linux.
# Run it after changing a dependency range in pyproject.toml, then commit both.
# Extra arguments go to `uv pip compile` (e.g. --upgrade-package pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
uv=$(command -v .venv/bin/uv || command -v uv || true)
if [ -z "$uv" ]; then
    echo "octfw lock: uv not found; run ./scripts/setup.sh first (it installs uv into .venv)" >&2
    exit 2
fi
exec "$uv" pip compile pyproject.toml --extra xla --extra dev \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --generate-hashes --annotation-style line \
    --custom-compile-command ./scripts/lock.sh \
    -o requirements.lock "$@"
