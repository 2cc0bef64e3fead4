#!/usr/bin/env bash
# Here (the CPU machine): download what the GPU machine lacks into two bundles under .whl/ (git-ignored), each under
# the 64 MiB a device call may carry. On the GPU machine: `source bench/gpu/setup_wheels.sh ga` in one call, then
# `source bench/gpu/setup_wheels.sh gb` in the next (within the machine's ~30 s warm window, which keeps /tmp/site).
#   ga  fla-core + flash-linear-attention 0.6.0, apache-tvm-ffi, torch-c-dlpack-ext, pydantic (the schema),
#       tilelang 0.1.15 + z3-solver unpacked into one tar.xz (fla's gated chunk backward on Hopper, Triton < 3.7.1),
#       and bitsandbytes 0.50.2 with only its CUDA 13 and CPU libraries (NF4 base)               (~55 MB)
#   gb  Prefect 3.9.1 with its dependencies                                                      (~38 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
dl() { d=$1; shift; mkdir -p $d; python3 -m pip download -q $P -d $d "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
W=${WHL:-.whl}  # where the bundles go (setup_wheels.sh reads .whl/)
rm -rf $W/ga $W/gb $W/tmp
dl $W/gb "prefect==3.9.1"
rm -f $W/gb/pydantic-2*.whl $W/gb/pydantic_core-*.whl $W/gb/annotated_types-*.whl $W/gb/typing_inspection-*.whl
dl $W/ga --no-deps pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  fla-core==0.6.0 flash-linear-attention==0.6.0 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext
dl $W/tmp --no-deps tilelang==0.1.15 z3-solver==4.15.4 bitsandbytes==0.50.2
W=$W python3 - <<'PY'
import glob, io, os, tarfile, zipfile
W = os.environ['W']
# tilelang + z3: unpacked wheel contents in one xz tar (zip's deflate leaves ~80 MB; xz -9 gets ~43 MB)
with tarfile.open(W + "/ga/tilelang-z3.tar.xz", "w:xz", preset=9) as tar:
    for w in glob.glob(W + "/tmp/tilelang-*.whl") + glob.glob(W + "/tmp/z3_solver-*.whl"):
        with zipfile.ZipFile(w) as z:
            for info in z.infolist():
                if info.is_dir() or ".data/" in info.filename:  # z3's bin/ and include/: not needed at run time
                    continue
                data = z.read(info)
                ti = tarfile.TarInfo(info.filename); ti.size = len(data); ti.mode = 0o755 if info.filename.endswith(".so") else 0o644
                tar.addfile(ti, io.BytesIO(data))
# bitsandbytes (in ga: gb is the larger download): only the CUDA 13 libraries (the machine's torch is cu130) and the CPU one; RECORD follows
src = glob.glob(W + "/tmp/bitsandbytes-*.whl")[0]
keep = lambda n: not n.endswith(".so") or any(k in n for k in ("cuda130", "cuda132", "_cpu"))
with zipfile.ZipFile(src) as z, zipfile.ZipFile(W + "/ga/" + os.path.basename(src), "w", zipfile.ZIP_DEFLATED) as out:
    for info in z.infolist():
        if not keep(info.filename):
            continue
        data = z.read(info)
        if info.filename.endswith("RECORD"):
            data = "".join(l + "\n" for l in data.decode().splitlines() if keep(l.split(",")[0])).encode()
        out.writestr(info, data)
PY
rm -rf $W/tmp
du -sh $W/ga $W/gb
