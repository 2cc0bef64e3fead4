#!/usr/bin/env bash
# README command 2: set up (the project, plus the optional vLLM CPU sampler so its tests run too), then the CPU test
# suite (slow tests included; gpu tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)" \
   || ! .venv/bin/python -c "import torchvision_cpu_shim" 2>/dev/null; then
  bash scripts/setup-vllm.sh .venv
fi
. .venv/bin/activate
exec python -m pytest -q "$@"
