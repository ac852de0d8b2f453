#!/usr/bin/env bash
# Creates .venv in the repository root and installs octfw with every extra the
# tests use (torch 2.9.0 + torch_xla 2.9.0, gcsfs, wandb, DICOM codecs, pytest
# and the GCS emulator). Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    echo "octfw setup: creating .venv with $python"
    "$python" -m venv .venv
fi
echo "octfw setup: installing octfw[xla,dev] into .venv (a fresh install downloads about 7 GB)"
.venv/bin/python -m pip install --disable-pip-version-check -q -e '.[xla,dev]'
echo "octfw setup: done; try .venv/bin/octfw list"
