#!/usr/bin/env bash
# README command 1: set up, then a short latent-GRPO run of the embedded default (tiny hybrid, built-in gym, CPU,
# one Prefect flow per step). Extra arguments go to `lgrpo train`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
exec lgrpo train "$@"
