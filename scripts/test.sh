#!/usr/bin/env bash
# README command 2: set up, then the CPU test suite (slow tests included; gpu tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
