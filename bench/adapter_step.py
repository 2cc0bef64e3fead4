"""The adapter's single-token step on one GPU: step_h's launch layouts at the 27B widths, inside a CUDA graph.

    python bench/adapter_step.py --rows 4 16 --out F.json

Why: in the graphed latent step and decoded token of the 27B recipe (4 rows), the adapter term of the 10 DoRA targets
runs as 256 step_h and 400 step_out launches (engine/cuda_graphs.FrozenAdapter: one step_h per sibling group or lone
projection, one step_out per projection); measured 1.96 + 1.41 ms of a 22.2 ms latent step on an H200
(h200-recipe-27b-nf4-kernels-2026-12-03.json), i.e. 7.6 us per step_h, whose program sums k_chunk / bk dependent loads
in a row. This bench replays exactly those launches of one model step (every layer, the configs' targets and widths,
sibling A matrices stacked as FrozenAdapter stacks them) in one CUDA graph per layout of engine.adapter_kernels.STEP
and prints the milliseconds per model step, with the PyTorch path (two FP32 GEMMs + the epilogue expressions) beside.

Each layout is qualified first (engine.adapter_kernels.qualify_step: within 1 BF16 ulp of PyTorch, as close to FP64 as
PyTorch), and the graph's outputs are compared with an eager run of the same layout (bit for bit: the thoughts'
eager-vs-graphed equality rests on it). Row 0 is today's STEP.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = [  # k_chunk, bk, warps
    (1024, 128, 4), (512, 128, 4), (256, 128, 4), (256, 256, 4), (512, 256, 4), (128, 128, 4), (256, 64, 2),
    (256, 128, 2), (512, 512, 4), (1024, 256, 8),
]


def model_step(arch: dict, targets: list[str], rank: int) -> list[dict]:
    """The adapter launches of one model step: per layer, sibling groups (one step_h over stacked A, one step_out per
    member) and lone projections (step_h + step_out), with their input and output widths."""
    h, inter = arch["hidden_size"], arch["intermediate_size"]
    kinds = arch.get("layer_types") or (["linear_attention"] * 3 + ["full_attention"]) * (arch["num_hidden_layers"] // 4)
    qd, kvd = arch["num_attention_heads"] * arch["head_dim"], arch["num_key_value_heads"] * arch["head_dim"]
    kd = arch["linear_num_key_heads"] * arch["linear_key_head_dim"]
    vd = arch["linear_num_value_heads"] * arch["linear_value_head_dim"]
    nv = arch["linear_num_value_heads"]
    outs = {"q_proj": (h, 2 * qd), "k_proj": (h, kvd), "v_proj": (h, kvd), "o_proj": (qd, h),
            "in_proj_qkv": (h, 2 * kd + vd), "in_proj_z": (h, vd), "in_proj_b": (h, nv), "in_proj_a": (h, nv),
            "out_proj": (vd, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    from engine.cuda_graphs import FrozenAdapter

    mlp = ["gate_proj", "up_proj", "down_proj"]
    per_kind = {"full_attention": ["q_proj", "k_proj", "v_proj", "o_proj"] + mlp,
                "linear_attention": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"] + mlp}
    step = []
    for kind in kinds:
        names = [n for n in per_kind[kind] if n in targets]
        done = set()
        for sib in FrozenAdapter.SIBLINGS:
            members = [n for n in names if n in sib]
            if len(members) >= 2:
                step.append({"in": outs[members[0]][0], "outs": [outs[n][1] for n in members], "rank": rank})
                done.update(members)
        step += [{"in": outs[n][0], "outs": [outs[n][1]], "rank": rank} for n in names if n not in done]
    return step


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[4, 16])
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick checks)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--layouts", nargs="+", default=None, metavar="K_CHUNK,BK,WARPS",
                   help="only these layouts (besides today's), e.g. 256,128,4")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a flow check under TRITON_INTERPRET=1 (eager, no graph; use --layers 1 --rows 1)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import os

    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from configs.schema import load_config
    from engine import adapter_kernels as AK

    cfg = load_config("qwen35-27b")
    arch = dict(cfg.model.arch)
    if a.layers:
        arch["num_hidden_layers"] = a.layers
        arch["layer_types"] = [("linear_attention", "linear_attention", "linear_attention", "full_attention")[i % 4]
                               for i in range(a.layers)]
    dev = torch.device(a.device)
    layouts = [tuple(int(v) for v in x.split(",")) for x in a.layouts] if a.layouts else LAYOUTS
    step = model_step(arch, list(cfg.adapter.targets), cfg.adapter.rank)
    s = cfg.adapter.alpha / cfg.adapter.rank
    res = {"args": vars(a), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)", "torch": torch.__version__,
           "launches_per_step": {"step_h": len(step), "step_out": sum(len(g["outs"]) for g in step)},
           "default": dict(AK.STEP), "rows": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    tensors = []  # per group: A stacked (FP32), per member (B, ms, base output); x per distinct input width
    for g in step:
        A = torch.randn(g["rank"] * len(g["outs"]), g["in"], device=dev, generator=gen) * g["in"] ** -0.5
        mem = [(torch.randn(o, g["rank"], device=dev, generator=gen) * 0.05,
                1.0 + 1e-2 * torch.randn(1, o, device=dev, generator=gen)) for o in g["outs"]]
        tensors.append((A, mem))

    for rows in a.rows:
        xs = {w: torch.randn(rows, 1, w, device=dev, generator=gen).bfloat16() for w in {g["in"] for g in step}}
        rs = [[torch.randn(rows, 1, o, device=dev, generator=gen).bfloat16() for o in g["outs"]] for g in step]

        def run_fused(out: list):
            out.clear()
            for g, (A, mem), r in zip(step, tensors, rs):
                x = xs[g["in"]]
                part = AK.step_h(x, A)
                for j, ((B, ms), rj) in enumerate(zip(mem, r)):
                    out.append(AK.step_fused(rj, x, A[j * g["rank"]:(j + 1) * g["rank"]], B, ms, None, s, True, False,
                                             part=part, part_off=j * g["rank"]))

        def run_torch(out: list):
            out.clear()
            for g, (A, mem), r in zip(step, tensors, rs):
                x = xs[g["in"]]
                for j, ((B, ms), rj) in enumerate(zip(mem, r)):
                    out.append(AK.step_torch(rj, x, A[j * g["rank"]:(j + 1) * g["rank"]].contiguous(), B, ms, None,
                                             s, True, False))

        def graphed_ms(fn) -> tuple[float, list]:
            out: list = []
            if dev.type != "cuda":  # the flow check: eager, timed once
                t = time.perf_counter()
                fn(out)
                return round((time.perf_counter() - t) * 1e3, 3), out
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                fn(out)  # warm-up (compiles)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                fn(out)
            graph.replay()
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            for _ in range(a.reps):
                graph.replay()
            torch.cuda.synchronize(dev)
            return round((time.perf_counter() - t) * 1e3 / a.reps, 3), out

        torch_ms, torch_out = graphed_ms(run_torch)
        row = {"rows": rows, "torch_ms_per_step": torch_ms, "layouts": []}
        print(f"rows {rows}: PyTorch path {torch_ms} ms per model step "
              f"({res['launches_per_step']['step_out']} adapted projections)", flush=True)
        saved = dict(AK.STEP)
        try:
            for kc, bk, w in [tuple(saved.values())] + [x for x in layouts if x != tuple(saved.values())]:
                AK.STEP.update(k_chunk=kc, bk=bk, warps=w)
                q = AK.qualify_step(dev)
                ms, gout = graphed_ms(run_fused)
                eager: list = []
                run_fused(eager)
                bitwise = all(torch.equal(x, y) for x, y in zip(gout, eager))
                ulps = max(float(AK._ulps_bf16(x, y).max()) for x, y in zip(gout, torch_out))
                ent = {"k_chunk": kc, "bk": bk, "warps": w, "ms_per_step": ms, "qualified": q["passed"],
                       "graph_equals_eager": bitwise, "max_ulps_vs_torch": ulps}
                row["layouts"].append(ent)
                print(f"  k_chunk {kc:>5} bk {bk:>4} warps {w}: {ms:7.3f} ms  qualified {q['passed']}  "
                      f"graph==eager {bitwise}  max ulps vs PyTorch {ulps:.0f}", flush=True)
        finally:
            AK.STEP.clear()
            AK.STEP.update(saved)
        ok = [e for e in row["layouts"] if e["qualified"] and e["graph_equals_eager"]]
        row["best"] = min(ok, key=lambda e: e["ms_per_step"]) if ok else None
        res["rows"].append(row)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
