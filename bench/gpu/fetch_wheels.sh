#!/usr/bin/env bash
# Here (the CPU machine): download the GPU machine's missing wheels into .whl/<part>/ (git-ignored), each part under
# the 64 MiB a device call may carry. On the GPU machine: `source bench/gpu/setup_wheels.sh <part>` per call, parts in
# order within the machine's warm window (it keeps /tmp/site between calls only while warm).
#   p  Prefect 3.9.1 with its dependencies, pydantic                       (~41 MB)   the Prefect step flow
#   a  pydantic (the versions Prefect resolves), fla-core + flash-linear-attention 0.6.0, apache-tvm-ffi,
#      torch-c-dlpack-ext, z3-solver                                     (~36 MB)
#   b  tilelang 0.1.15 (fla's gated chunk backward on Hopper with Triton < 3.7.1)   (~50 MB)
#   n  bitsandbytes 0.50.2 (NF4 base)                                        (~43 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
dl() { part=$1; shift; mkdir -p .whl/$part; python3 -m pip download -q $P -d .whl/$part "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
dl p "prefect==3.9.1"
dl a --no-deps pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 fla-core==0.6.0 flash-linear-attention==0.6.0 apache-tvm-ffi==0.1.12 z3-solver==4.15.4 torch-c-dlpack-ext
dl b --no-deps tilelang==0.1.15
dl n --no-deps bitsandbytes==0.50.2
du -sh .whl/*
