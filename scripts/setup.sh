#!/usr/bin/env bash
# Creates .venv in the repository root and installs exactly requirements.lock
# (octfw's runtime and dev dependencies, torch 2.9.0 + torch_xla 2.9.0
# included, pinned with hashes), then octfw itself in editable mode.
# Safe to run again: pip skips what is already installed at the locked version.
# To change a dependency: edit pyproject.toml, run ./scripts/lock.sh, commit both.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    echo "octfw setup: creating .venv with $python"
    "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
echo "octfw setup: installing requirements.lock into .venv (a fresh install downloads about 4 GB)"
"${pip[@]}" install --require-hashes --no-deps -r requirements.lock
# No build isolation: setuptools and wheel come from the lock, not the index.
"${pip[@]}" install --no-deps --no-build-isolation -e .
echo "octfw setup: done; try .venv/bin/octfw list"
