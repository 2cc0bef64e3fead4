#!/usr/bin/env bash
# On the lent H200: install the carried wheels (bench/gpu/fetch_wheels.sh made them) into /tmp/site. The machine keeps
# /tmp only while warm (about 30 s after a call), so parts go in consecutive calls, one part carried per call.
# Usage: source bench/gpu/setup_wheels.sh a|b|p|n      (b needs a in the same warm machine)
part=$1
if [ "$part" = b ] && [ ! -f /tmp/site/.lgrpo-part-a ]; then
  echo "COLD: /tmp/site from part a is gone (the machine was given back); run part a again first"; return 3 2>/dev/null || exit 3
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/$part/*.whl || { echo "pip failed"; return 2 2>/dev/null || exit 2; }
touch /tmp/site/.lgrpo-part-$part
export PYTHONPATH=/tmp/site:$PWD
export TRITON_CACHE_DIR=/tmp/triton-cache TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
