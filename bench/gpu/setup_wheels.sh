#!/usr/bin/env bash
# On the lent H200: install the carried wheels into /tmp/site (see shared DEVICE notes: the machine keeps /tmp while
# warm, so the GPU extra travels in two calls: .whl/a = pydantic + fla + tilelang's dependencies, .whl/b = tilelang).
# Usage: source bench/gpu/setup_wheels.sh a|b
part=$1
if [ "$part" = b ] && [ ! -f /tmp/site/.lgrpo-part-a ]; then
  echo "COLD: /tmp/site from part a is gone (the machine was given back); run part a again first"; return 3 2>/dev/null || exit 3
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/$part/*.whl || { echo "pip failed"; return 2 2>/dev/null || exit 2; }
touch /tmp/site/.lgrpo-part-$part
export PYTHONPATH=/tmp/site:$PWD
export TRITON_CACHE_DIR=/tmp/triton-cache TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
