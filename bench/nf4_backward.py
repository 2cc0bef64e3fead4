"""Why the NF4 base layers' backward costs ~1.6x their forward in replay (27B width, H200), and what fixes it.

    python bench/nf4_backward.py --tokens 7281 --out F.json

Replay back-propagates into the frozen NF4 base only for the input gradient: grad_x = grad_y @ dequant(W), one GEMM
of the forward's size. The attribution (bench/replay_profile.py --parts 4) measured it at 19.7 ms against 12.5 ms
forward per 8 layers for the MLP projections, with 5x the kernels. This bench:

1. times, for each MLP projection shape of the 27B text model, the bitsandbytes forward, its backward
   (MatMul4Bit.backward: dequantize + torch.matmul), and the pieces: dequantize alone, the GEMM on a contiguous
   BF16 gradient in each layout, and lists the CUDA kernels each launches;
2. records what reaches MatMul4Bit.backward in the project's real replay path (engine.replay.score_microbatch,
   checkpoint tier, then stages.optimize.accumulate_gradients) on a --layers model: dtype, shape, strides,
   contiguity of grad_output, per projection.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn, reps: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def kernels(fn) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    c = Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            c[ev.name[:90]] += 1
    return [f"{n} x{k}" for n, k in c.most_common(8)]


def shapes_part(T: int, dims: list[tuple[str, int, int]]) -> list[dict]:
    import bitsandbytes.functional as BF
    import torch

    out = []
    for name, fin, fout in dims:
        from engine.nf4 import _quantize_modules_

        holder = torch.nn.Module()
        holder.gate_proj = torch.nn.Linear(fin, fout, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(holder.gate_proj.weight, 0, 0.02)
        _quantize_modules_(holder)  # as the 27B step quantizes its base (engine.nf4)
        lin = holder.gate_proj
        x = torch.randn(1, T, fin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(1, T, fout, device="cuda", dtype=torch.bfloat16)
        W = BF.dequantize_4bit(lin.weight.data, lin.weight.quant_state)  # (out, in), the quant state's dtype
        row0 = {"dequantized_dtype": str(W.dtype)}
        W = W.to(torch.bfloat16)
        flop = 2 * T * fin * fout
        y = lin(x)

        def fwd():
            with torch.no_grad():
                lin(x)

        def bwd():
            torch.autograd.grad(y, x, g, retain_graph=True)

        def dq():
            BF.dequantize_4bit(lin.weight.data, lin.weight.quant_state)

        g2 = g.view(-1, fout)
        Wt = W.t().contiguous()
        pieces = {
            "forward_bnb": fwd, "backward_bnb": bwd, "dequantize": dq,
            "matmul_3d_g@W": lambda: torch.matmul(g, W),
            "mm_2d_g@W": lambda: torch.mm(g2, W),
            "linear_g,Wt(contig)": lambda: torch.nn.functional.linear(g2, Wt),
            "mm_g@W_fp32grad": lambda: torch.mm(g2.float(), W.float()),
        }
        row = {"proj": name, "in": fin, "out": fout, "T": T, **row0, "ms": {}, "tflops": {}, "kernels": {}}
        for k, fn in pieces.items():
            ms = timed(fn)
            row["ms"][k] = round(ms, 3)
            if k != "dequantize":
                row["tflops"][k] = round(flop / ms / 1e9, 1)
            if k in ("forward_bnb", "backward_bnb", "matmul_3d_g@W", "mm_2d_g@W"):
                row["kernels"][k] = kernels(fn)
        out.append(row)
        print(json.dumps(row), flush=True)
        del lin, holder, x, g, W, Wt, y
        torch.cuda.empty_cache()
    return out


def real_path(layers: int, T: int) -> dict:
    import bitsandbytes.autograd._functions as BA
    import torch

    from configs.schema import ReplayConfig, load_config
    from engine import adapter_kernels, gdn
    from engine import model as M
    from engine.nf4 import quantize_nf4_
    from engine.replay import TokenCosts, plan_for
    from recipe_27b import build_random, with_adapter
    from replay_27b import Eng, make_turns, run_plan

    cfg27 = load_config("qwen35-27b")
    arch = dict(cfg27.model.arch)
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    arch.update(num_hidden_layers=layers, layer_types=[kinds[i % 4] for i in range(layers)])
    base = build_random(arch, arch["vocab_size"], torch.device("cuda"), torch.bfloat16, 0)
    quantize_nf4_(base)
    model = with_adapter(base, cfg27.adapter, 0)
    gdn.install("auto", M._parts(model)[0].config, torch.device("cuda"))
    adapter_kernels.install("auto", torch.device("cuda"))
    eng = Eng(model)
    eng._replay_costs = TokenCosts(30 * 2**20, 2**20, 2**20, "config")
    rc = ReplayConfig(keep_graph_tokens=0)
    turns = make_turns([T - 16 - 64 - 1], 16, 64, arch["hidden_size"], arch["vocab_size"], eng.scale, 7)
    plan = plan_for(eng, turns, rc, 1.0, 0.05)
    seen: dict = defaultdict(Counter)
    orig = BA.MatMul4Bit.backward

    def spy(ctx, grad_output):
        key = (str(grad_output.dtype), tuple(grad_output.shape), tuple(grad_output.stride()),
               grad_output.is_contiguous())
        seen[str(tuple(ctx.state.shape))][str(key)] += 1
        return orig(ctx, grad_output)

    BA.MatMul4Bit.backward = staticmethod(spy)
    try:
        r = run_plan(eng, turns, rc, plan=plan)
    finally:
        BA.MatMul4Bit.backward = orig
    return {"run": {k: r[k] for k in ("score_s", "backward_s", "total_s", "tokens")},
            "tf32": torch.backends.cuda.matmul.allow_tf32,
            "grad_output_by_weight_shape": {k: dict(v) for k, v in seen.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=7281)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the real-path model (part 2)")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    res: dict = {"args": vars(a), "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    if 1 in a.parts:
        d, f = 5120, 17408
        res["shapes"] = shapes_part(a.tokens, [("gate/up", d, f), ("down", f, d)])
    if 2 in a.parts:
        res["real_path"] = real_path(a.layers, a.tokens)
        print(json.dumps(res["real_path"], indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
