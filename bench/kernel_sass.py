"""Instructions per weight of the NF4 small-batch kernel's inner loop, read from its SASS -- on the CPU, no GPU.

Triton compiles ahead of time for a target it is not running on (sm_90 here: H100/H200) with the ptxas it ships;
cuobjdump (also shipped) prints the SASS. This finds the kernel's loop (the backward branch), counts its
instructions by opcode, and divides by the weights one thread handles per iteration. It is how the NF4 kernel's
lookups were compared (engine/nf4_kernels.py's status): the layout sweep on the GPU times them, this says why.

    python bench/kernel_sass.py                      # every lookup of the wdot form at CONFIG's block sizes
    python bench/kernel_sass.py --form gemm --luts shuffle select

Integer arguments are compiled as divisible by 16 (as Triton's JIT specializes the 27B shapes' sizes)."""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARGS = {"x_ptr": "*bf16", "w_ptr": "*u8", "am_ptr": "*fp32", "lut_ptr": "*fp32", "bias_ptr": "*bf16",
        "out_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "sx": "i32", "so": "i32",
        "KS": "i32"}
DIVISIBLE = ("N", "K", "sx", "so", "KS")


def compile_sass(form: str, lut: str, bn: int, bk: int, warps: int, stages: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine import _nf4_triton as T

    consts = {"HAS_BIAS": False, "BLOCKSIZE": 64, "BN": bn, "BK": bk, "FINAL": False, "LUT": lut}
    if form == "gemm":
        fn = T.nf4_small_gemm
        consts.update(BM=16, ROW_BLOCKS=True, MMA=True, DOT_F32=False)
    elif form == "wdot":
        fn, consts["DOT_F32"] = T.nf4_wdot, False
    else:
        fn, consts["SOFT_ROUND"] = T.nf4_gemv, False
    names = list(fn.arg_names)  # the kernel's parameter order
    sig = {k: ARGS.get(k, "constexpr") for k in names}
    if lut == "pairs":
        sig["lut_ptr"] = "*i64"
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in names
             if sig[k].startswith("*") or k in DIVISIBLE}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    return sass, int(regs.group(1)) if regs else None


def loop_counts(sass: str) -> collections.Counter:
    """Opcode counts of the longest loop (from a backward branch's target to the branch)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best = collections.Counter()
    for a, text in ins:
        m = re.search(r"BRA 0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a:
            body = [t for x, t in ins if int(m.group(1), 16) <= x <= a]
            c = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            if sum(c.values()) > sum(best.values()):
                best = c
    return best


def main() -> int:
    from engine import nf4_kernels as NK

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--form", choices=["gemm", "wdot", "fma"], default="wdot")
    p.add_argument("--luts", nargs="+", default=["prmt", "shuffle", "select", "gather"],
                   choices=["prmt", "shuffle", "select", "gather", "pairs"])
    p.add_argument("--block-n", type=int, default=NK.CONFIG["block_n"])
    p.add_argument("--block-k", type=int, default=NK.CONFIG["block_k"])
    p.add_argument("--warps", type=int, default=NK.CONFIG["warps"])
    p.add_argument("--stages", type=int, default=NK.CONFIG["stages"])
    a = p.parse_args()
    rows = []
    for lut in a.luts:
        sass, regs = compile_sass(a.form, lut, a.block_n, a.block_k, a.warps, a.stages)
        c = loop_counts(sass)
        weights = a.block_n * 64 / (32 * a.warps)  # one absmax block (64 inputs) per loop step and row
        if a.form == "gemm" or a.form == "wdot":
            weights *= a.block_k // 64
        n = sum(c.values())
        rows.append({"form": a.form, "lut": lut, "registers": regs, "loop_instructions": n,
                     "weights_per_thread": weights, "per_weight": round(n / weights, 2),
                     "top": dict(c.most_common(8))})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
