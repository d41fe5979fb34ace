#!/usr/bin/env bash
# Set up pkb in ./.venv: reuse a torch the system Python already has (e.g. a CUDA build), else
# install torch 2.13.0; then pkb itself with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${PKB_TORCH_SPEC:-torch==2.13.0}"

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "$TORCH_SPEC"
fi
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -c "import torch, pkb; print(f'pkb {pkb.__version__} with torch {torch.__version__} ready in .venv')"
