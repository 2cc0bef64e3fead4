#!/usr/bin/env bash
# On the lent H200: install a carried bundle (bench/gpu/fetch_wheels.sh made them) into /tmp/site. The machine keeps
# /tmp only while warm (about 30 s after a call), so bundles go in consecutive calls, one bundle carried per call.
# Usage: source bench/gpu/setup_wheels.sh ga|gb      (ga: fla + tilelang + pydantic + bitsandbytes; gb: Prefect)
part=$1
if [ -f /tmp/site/.lgrpo-part-$part ]; then
  echo "bundle $part already installed in /tmp/site (warm machine)"
else
  mkdir -p /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/$part/*.whl || { echo "pip failed"; return 2 2>/dev/null || exit 2; }
  for t in .whl/$part/*.tar.xz; do  # unpacked wheels (xz packs tilelang + z3 under one call's 64 MiB)
    [ -f "$t" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp/site')" "$t"
  done
  touch /tmp/site/.lgrpo-part-$part
fi
ls /tmp/site/.lgrpo-part-* 2>/dev/null | sed 's#.*/.lgrpo-part-#installed bundle: #'
export PYTHONPATH=/tmp/site:$PWD
export TRITON_CACHE_DIR=/tmp/triton-cache TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
