"""Where replay time goes at the Qwen3.5-27B width: first-call cost of new sequence lengths, and a kernel profile.

    python bench/replay_profile.py --layers 8 --out F.json

Model: the 27B text shape with --layers decoder layers (3 GDN : 1 attention), random BF16 weights (--base nf4: then
quantized to NF4 as in the 27B step), DoRA r16 with FP32
masters, GDN kernels chosen by engine/gdn.py. Each case scores one micro-batch through engine.replay.score_microbatch
in the checkpoint tier and back-propagates Σ w·logp through stages.optimize.accumulate_gradients, as a step does.

1. Sequence-length sequence A, B, A, C, B, ...: seconds per call. A length seen before runs warm; a new length pays
   whatever the kernels compile or autotune per shape (Triton autotuning, tilelang JIT) -- in a real step every
   micro-batch has its own length.
2. Rows: one row of 2·n tokens against two rows of n (a padded, masked batch) at the same token count, warm.
3. torch.profiler over one warm micro-batch: the top CUDA kernels by total time, grouped by name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--lengths", type=int, nargs="+", default=[3300, 3500, 3300, 3700, 3500])
    p.add_argument("--rows-tokens", type=int, default=3600, help="n for the 1x2n vs 2xn comparison")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--base", choices=["bf16", "nf4"], default="bf16", help="nf4: bitsandbytes NF4 base, as the 27B step")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], help="which of the three parts to run")
    p.add_argument("--adapter-kernels", choices=["auto", "torch"], default="auto",
                   help="the LoRA/DoRA epilogue (engine/adapter_kernels.py): fused where qualified, or PyTorch's")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch

    from configs.schema import ReplayConfig, load_config
    from engine import gdn
    from engine import model as M
    from recipe_27b import build_random, with_adapter
    from replay_27b import Eng, make_turns, run_plan

    dev = torch.device("cuda")
    cfg27 = load_config("qwen35-27b")
    arch = dict(cfg27.model.arch)
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    arch.update(num_hidden_layers=a.layers, layer_types=[kinds[i % 4] for i in range(a.layers)])
    vocab = arch["vocab_size"]
    base = build_random(arch, vocab, dev, torch.bfloat16, 0)
    if a.base == "nf4":
        from engine.nf4 import quantize_nf4_

        quantize_nf4_(base)
    model = with_adapter(base, cfg27.adapter, 0)
    res: dict = {"args": vars(a), "versions": gdn.versions(),
                 "gdn": gdn.install("auto", M._parts(model)[0].config, dev)}
    from engine import adapter_kernels

    res["adapter_kernels"] = adapter_kernels.install(a.adapter_kernels, dev)
    eng = Eng(model)
    d = arch["hidden_size"]
    rc = ReplayConfig(keep_graph_tokens=0)  # every micro-batch in the checkpoint tier
    from engine.replay import TokenCosts

    eng._replay_costs = TokenCosts(30 * 2**20, 2**20, 2**20, "config")  # generous: no measuring probe per case

    def case(prefixes, seed):
        turns = make_turns(prefixes, 16, 64, d, vocab, eng.scale, seed)
        from engine.replay import plan_for

        plan = plan_for(eng, turns, rc, 1.0, 0.05)
        return turns, plan

    res["lengths"] = []
    for i, n in enumerate(a.lengths if 1 in a.parts else []):
        turns, plan = case([n], 100 + i)
        r = run_plan(eng, turns, rc, plan=plan)
        row = {"prefix_tokens": n, "tokens": r["tokens"], "total_s": r["total_s"], "score_s": r["score_s"],
               "backward_s": r["backward_s"]}
        res["lengths"].append(row)
        print(json.dumps(row), flush=True)

    n = a.rows_tokens
    res["rows"] = []
    for label, prefixes in (("1x2n", [2 * n]), ("2xn", [n, n]), ("2xn-ragged", [n, n - 400])) if 2 in a.parts else ():
        turns, plan = case(prefixes, 7)
        run_plan(eng, turns, rc, plan=plan)  # warm
        r = run_plan(eng, turns, rc, plan=plan)
        row = {"case": label, "prefixes": prefixes, "microbatches": len(plan.microbatches), "tokens": r["tokens"],
               "total_s": r["total_s"], "tokens_per_s": round(r["tokens"] / r["total_s"], 1)}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)

    if 3 in a.parts:
        from torch.profiler import ProfilerActivity, profile

        turns, plan = case([2 * n], 7)
        warm = run_plan(eng, turns, rc, plan=plan)  # this length's compile and autotuning, outside the profile
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            run_plan(eng, turns, rc, plan=plan)
        by = defaultdict(lambda: [0.0, 0])
        total = 0.0
        for ev in prof.key_averages():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = ev.self_device_time_total
            by[ev.key][0] += t
            by[ev.key][1] += ev.count
            total += t
        top = sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]
        res["profile"] = {"kernel_ms_total": round(total / 1e3, 1), "tokens": sum(turns.lengths()),
                          "warm_run": {k: warm[k] for k in ("total_s", "score_s", "backward_s")},
                          "top": [{"kernel": k[:160], "ms": round(v[0] / 1e3, 2), "calls": v[1]} for k, v in top]}
        print(json.dumps(res["profile"], indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
