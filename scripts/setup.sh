#!/usr/bin/env bash
# Creates .venv and installs the project (CPU torch 2.13.0 from the local wheel, then everything else).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -c constraints.txt -e .   # the tested versions (constraints.txt says why)
