"""Launch layouts of the decode attention kernels and the NF4 small-batch kernel, timed on the GPU at the 27B shapes.

Each kernel's layout (engine.attention_kernels.CONFIG, engine.nf4_kernels.CONFIG: block sizes, key splits or input
splits, warps, pipeline stages, the NF4 level lookup) decides how fast it runs and the order of its FP32 sums. This
bench times the alternatives inside CUDA graphs (as the latent loop and the decoder run them: no launch overhead
from Python), checks every layout's output against the PyTorch path, and prints per-step totals for the 27B model
against the paths in use today and the HBM floor:

- decode attention: batch 4, 24 query heads over 4 KV heads, head dim 256, one query token, caches of 4k and 8k
  positions; per step = 16 attention layers. Against engine.attention_kernels.gqa_torch (the FP32 PyTorch path).
- NF4: 4 rows through every projection shape of the 27B model (the 496 quantized linears: 48 Gated DeltaNet layers'
  in_proj_qkv/z/b/a and out_proj, 16 attention layers' q/k/v/o, 64 MLPs); per step = the sum over all 496. Against
  bitsandbytes' Linear4bit forward (dequantize, then cuBLAS: the NF4 trainer's path) and cuBLAS on the dequantized
  BF16 weight (the sampler's copy).

The search is staged (block sizes first, then warps / stages / programs around the best two) to keep compiles
within one call; the best layouts and the qualification tables of both kernels at those layouts (the same check
`install` runs) go to the JSON. `--apply FILE` in bench/recipe_27b.py reads them back.

Usage (GPU): python3 bench/kernel_sweep.py --out bench/results/h200-kernel-sweep-DATE.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HBM_TBS = 4.8  # TB/s, the floors' yardstick: main() sets the running card's (hbm_tb_per_s)
ATTN_KEYS = (4096, 8192)  # cache positions of the attention cases

# (out, in, count per step) of the 27B model's quantized projections (Qwen3.5-27B text shape)
NF4_SHAPES = ((10240, 5120, 48), (6144, 5120, 48), (48, 5120, 96), (5120, 6144, 48 + 16), (12288, 5120, 16),
              (1024, 5120, 32), (17408, 5120, 128), (5120, 17408, 64))


def hbm_tb_per_s(device_name: str) -> float:
    """HBM bandwidth of the lent cards, TB/s: H100 SXM (HBM3) 3.35, H200 (HBM3e) 4.8 (bench/recipe_27b.py too)."""
    return 3.35 if "H100" in device_name else 4.8


def graph_ms(fn, calls: int = 20, replays: int = 5) -> float:
    """ms per call of fn, run `calls` times inside one CUDA graph, replayed `replays` times (after a warm-up)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(replays):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / (replays * calls)


def layout_errors() -> tuple:
    """What a launch layout that does not fit the GPU raises (too much shared memory, a block Triton cannot lower):
    such a layout is reported in its row, not fatal; any other error stops the sweep."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return OutOfResources, CompilationError


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def sweep_attention(dev, quick: bool) -> dict:
    import torch

    from engine import attention_kernels as AT

    B, H, kvh, hd, layers = 4, 24, 4, 256, 16
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = []
    for L in ATTN_KEYS:
        q = (torch.randn(B, 1, H, hd, generator=g) * 2).to(dev, torch.bfloat16).transpose(1, 2)
        k = (torch.randn(B, kvh, L, hd, generator=g) * 2).to(dev, torch.bfloat16)
        v = torch.randn(B, kvh, L, hd, generator=g).to(dev, torch.bfloat16)
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=dev)
        mask[:, :, :, L - 300:] = False  # the unwritten tail of a static cache
        mask[1, :, :, :200] = False  # left padding
        ref = AT.gqa_torch(q, k, v, mask, hd ** -0.5)
        cases.append({"keys": L, "q": q, "k": k, "v": v, "mask": mask, "ref": ref,
                      "torch_ms": graph_ms(lambda: AT.gqa_torch(q, k, v, mask, hd ** -0.5)),
                      "floor_ms": 2 * B * kvh * L * hd * 2 / (HBM_TBS * 1e9)})
    default = dict(AT.CONFIG)

    def run(cfg) -> dict:
        AT.CONFIG.clear()
        AT.CONFIG.update({**default, **cfg})
        row = {**cfg, "ms": {}, "rel_to_torch": {}}
        try:
            for c in cases:
                f = lambda c=c: AT.gqa_fused(c["q"], c["k"], c["v"], c["mask"], hd ** -0.5)  # noqa: E731
                row["rel_to_torch"][c["keys"]] = rel(f(), c["ref"])
                row["ms"][c["keys"]] = graph_ms(f)
        except layout_errors() as e:  # a layout that does not fit (shared memory, registers) is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["ok"] = "error" not in row and all(r < 1e-2 for r in row["rel_to_torch"].values())
        print("attention", json.dumps({k: v for k, v in row.items()}), flush=True)
        return row

    stage1 = [{"split_keys": s, "block_keys": b, "warps": 4, "stages": 2}
              for s, b in itertools.product((128, 256, 512, 1024), (32, 64, 128)) if s >= b]
    if quick:
        stage1 = stage1[:3]
    rows = [run(c) for c in stage1]
    good = sorted((r for r in rows if r["ok"]), key=lambda r: r["ms"][ATTN_KEYS[0]])
    stage2 = []
    for best in good[:2]:
        for w, st in itertools.product((4, 8), (1, 2, 3)):
            c = {"split_keys": best["split_keys"], "block_keys": best["block_keys"], "warps": w, "stages": st}
            if c not in stage2 and not any(all(r.get(k) == v for k, v in c.items()) for r in rows):
                stage2.append(c)
    rows += [run(c) for c in (stage2[:4] if quick else stage2)]
    good = sorted((r for r in rows if r["ok"]), key=lambda r: r["ms"][ATTN_KEYS[0]])
    best = good[0] if good else None
    AT.CONFIG.clear()
    AT.CONFIG.update({**default, **({k: best[k] for k in ("split_keys", "block_keys", "warps", "stages")}
                                    if best else {})})
    qual = AT.qualify(dev)
    out = {"shape": {"batch": B, "heads": H, "kv_heads": kvh, "head_dim": hd, "query_tokens": 1},
           "baseline": {c["keys"]: {"torch_ms": c["torch_ms"], "floor_ms": c["floor_ms"]} for c in cases},
           "rows": rows, "best": {k: best[k] for k in ("split_keys", "block_keys", "warps", "stages")} if best else None,
           "best_ms": best["ms"] if best else None, "qualification_at_best": qual}
    if best:
        out["per_step_ms_16_layers"] = {L: {"kernels": 16 * best["ms"][L], "torch": 16 * out["baseline"][L]["torch_ms"],
                                            "floor": 16 * out["baseline"][L]["floor_ms"]} for L in ATTN_KEYS}
    AT.CONFIG.clear()
    AT.CONFIG.update(default)
    return out


def sweep_nf4(dev, quick: bool, luts=("shuffle", "select"), mmas=(True, False), forms=("gemm",),
              refine: int = 1) -> dict:
    import bitsandbytes as bnb
    import torch

    from engine import nf4_kernels as NK

    g = torch.Generator(device="cpu").manual_seed(0)
    M = 4
    shapes = []
    for N, K, count in NF4_SHAPES:
        w = (torch.randn(N, K, generator=g) * 0.02).to(dev, torch.bfloat16)
        packed, qs = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4",
                                                  quant_storage=torch.uint8)

        class _Mod:  # the attributes NF4Weight.of reads (a Linear4bit's weight)
            weight = type("P", (), {"data": packed, "quant_state": qs})()

        nw = NK.NF4Weight.of(_Mod)
        wref = bnb.functional.dequantize_4bit(packed, qs).to(torch.bfloat16)
        x = torch.randn(M, K, generator=g).to(dev, torch.bfloat16)
        ref = torch.nn.functional.linear(x, wref)
        nf4_bytes = N * K // 2 + N * K // 64  # packed codes + one byte of absmax per block (bitsandbytes' nested)
        with torch.no_grad():
            shapes.append({"out": N, "in": K, "count": count, "x": x, "nw": nw, "ref": ref,
                           "bnb_ms": graph_ms(lambda x=x, packed=packed, qs=qs: bnb.matmul_4bit(x, packed.t(), quant_state=qs)),
                           "bf16_ms": graph_ms(lambda x=x, wref=wref: torch.nn.functional.linear(x, wref)),
                           "floor_ms": (nf4_bytes + N * K // 64 * 3) / (HBM_TBS * 1e9),  # the kernel reads FP32 absmax
                           "bf16_floor_ms": N * K * 2 / (HBM_TBS * 1e9)})
        del w, wref
    default = dict(NK.CONFIG)

    def total(row_ms) -> float:
        return sum(s["count"] * row_ms[f"{s['out']}x{s['in']}"] for s in shapes)

    def run(cfg) -> dict:
        NK.CONFIG.clear()
        NK.CONFIG.update({**default, **cfg})
        row = {**cfg, "ms": {}, "rel_to_torch": {}}
        try:
            with torch.no_grad():
                for s in shapes:
                    f = lambda s=s: NK.nf4_linear(s["x"], s["nw"])  # noqa: E731
                    key = f"{s['out']}x{s['in']}"
                    row["rel_to_torch"][key] = rel(f(), s["ref"])
                    row["ms"][key] = graph_ms(f)
            row["step_ms"] = total(row["ms"])
        except layout_errors() as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["ok"] = "error" not in row and all(r < 1e-2 for r in row["rel_to_torch"].values())
        print("nf4", json.dumps({k: v for k, v in row.items() if k != "ms"}), flush=True)
        return row

    stage1 = [{**default}]  # today's layout, timed in the same run
    if "gemm" in forms:
        stage1 += [{"block_n": bn, "block_k": bk, "lut": lut, "mma": mma, "programs": 512, "warps": 4, "stages": 3,
                    "form": "gemm"}
                   for bn, bk, lut, mma in itertools.product((32, 64, 128, 256), (64, 256),
                                                             luts, mmas)  # gather/pairs: 90-95 ms (2026-12-03)
                   if mma or bn <= 128]  # register products: (4, BN, 32) FP32 per step
    if "fma" in forms:  # four (BN, 32) FP32 accumulators per program: BN <= 64 keeps them in registers
        stage1 += [{"block_n": bn, "block_k": bk, "lut": lut, "mma": False, "programs": pr, "warps": w, "stages": 3,
                    "form": "fma"}
                   for bn, bk, lut, pr, w in itertools.product((16, 32, 64), (64, 256), luts, (1024,), (4,))]
    if "wdot" in forms:  # the weights as the MMA's first operand: 64 or 128 outputs per program
        stage1 += [{"block_n": bn, "block_k": bk, "lut": lut, "mma": True, "programs": 1024, "warps": 4,
                    "stages": 3, "form": "wdot"}
                   for bn, bk, lut in itertools.product((64, 128), (64, 256), luts)]
    if quick:
        stage1 = stage1[:3]
    rows = [run(c) for c in stage1]
    good = sorted((r for r in rows if r["ok"]), key=lambda r: r["step_ms"])
    stage2 = []
    for best in good[:refine]:
        for w, st, pr in itertools.product((4, 8), (2, 3, 4), (512, 1024, 2048)):
            c = {"block_n": best["block_n"], "block_k": best["block_k"], "lut": best["lut"],
                 "mma": best["mma"], "programs": pr, "warps": w, "stages": st, "form": best.get("form", "gemm")}
            if c not in stage2 and not any(all(r.get(k) == v for k, v in c.items()) for r in rows):
                stage2.append(c)
    rows += [run(c) for c in (stage2[:4] if quick else stage2)]
    good = sorted((r for r in rows if r["ok"]), key=lambda r: r["step_ms"])
    keys = ("block_n", "block_k", "lut", "mma", "programs", "warps", "stages", "form")
    best = good[0] if good else None
    NK.CONFIG.clear()
    NK.CONFIG.update({**default, **({k: best[k] for k in keys} if best else {})})
    qual = NK.qualify(dev)
    base = {f"{s['out']}x{s['in']}": {k: s[k] for k in ("count", "bnb_ms", "bf16_ms", "floor_ms", "bf16_floor_ms")}
            for s in shapes}
    out = {"rows_per_call": M, "shapes": base, "rows": rows, "best": {k: best[k] for k in keys} if best else None,
           "qualification_at_best": qual,
           "per_step_ms_496_projections": {
               "kernel": best["step_ms"] if best else None,
               "bitsandbytes": sum(s["count"] * s["bnb_ms"] for s in shapes),
               "bf16_cublas": sum(s["count"] * s["bf16_ms"] for s in shapes),
               "nf4_floor": sum(s["count"] * s["floor_ms"] for s in shapes),
               "bf16_floor": sum(s["count"] * s["bf16_floor_ms"] for s in shapes)}}
    NK.CONFIG.clear()
    NK.CONFIG.update(default)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--only", choices=["attention", "nf4"], default=None)
    p.add_argument("--quick", action="store_true", help="a few layouts only (a smoke run)")
    p.add_argument("--luts", nargs="+", default=["shuffle", "select"], choices=["shuffle", "select", "gather", "pairs", "prmt"],
                   help="NF4 level lookups to sweep (engine.nf4_kernels.CONFIG lut)")
    p.add_argument("--tensor-cores-only", action="store_true", help="NF4: skip the register-product layouts")
    p.add_argument("--forms", nargs="+", default=["gemm", "fma", "wdot"], choices=["gemm", "fma", "wdot"],
                   help="NF4 kernel forms to sweep (engine.nf4_kernels.CONFIG form)")
    p.add_argument("--stage2", type=int, default=1, help="NF4: refine warps/stages/programs around this many best")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("kernel_sweep times CUDA kernels: no GPU here (the kernels' CPU tests run under Triton's interpreter)")
        return 2
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    global HBM_TBS
    HBM_TBS = hbm_tb_per_s(res["device"])
    res["hbm_tb_per_s"] = HBM_TBS  # the floors' yardstick
    import triton

    res["triton"] = triton.__version__
    if a.only in (None, "attention"):
        res["attention"] = sweep_attention(dev, a.quick)
        print("attention best", res["attention"]["best"], res["attention"].get("per_step_ms_16_layers"), flush=True)
    if a.only in (None, "nf4"):
        res["nf4"] = sweep_nf4(dev, a.quick, tuple(a.luts), (True,) if a.tensor_cores_only else (True, False),
                               tuple(a.forms), a.stage2)
        print("nf4 best", res["nf4"]["best"], res["nf4"]["per_step_ms_496_projections"], flush=True)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
