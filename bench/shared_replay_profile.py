"""Where prefix-shared replay's time goes at the 27B width (engine/shared_replay.py), against the per-turn path.

    python bench/shared_replay_profile.py --layers 8 --out F.json

The 27B text shape with --layers decoder layers (3 GDN : 1 attention), NF4 base, DoRA r16 FP32 masters, GDN kernels
chosen by engine/gdn.py; one recipe group (4 rows x 4 turns, 3,072-token prompt, 16 thoughts, 64 answer and 128 tool
tokens) scored in the checkpoint tier and back-propagated, per turn and shared, three runs each (the first pays
compiles): forward and backward seconds per run, the shared schedule's forwards timed one by one (synchronised), and
a torch.profiler table of the last shared run's kernels and CPU ops.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--base", choices=["nf4", "bf16"], default="nf4")
    p.add_argument("--width", choices=["27b", "small"], default="27b",
                   help="small: a narrow model of the same layout (a CPU smoke test of this script)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch

    from configs.schema import ReplayConfig, load_config
    from engine import gdn
    from engine import model as M
    from engine import shared_replay as SR
    from engine.replay import score_microbatch
    from recipe_27b import build_random, with_adapter
    from replay_27b import Eng, make_episodes

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg27 = load_config("qwen35-27b")
    arch = dict(cfg27.model.arch)
    if a.width == "small":
        arch.update(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64, vocab_size=1000)
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    arch.update(num_hidden_layers=a.layers, layer_types=[kinds[i % 4] for i in range(a.layers)])
    base = build_random(arch, arch["vocab_size"], dev, torch.bfloat16, 0)
    if a.base == "nf4":
        from engine.nf4 import quantize_nf4_

        quantize_nf4_(base)
    model = with_adapter(base, cfg27.adapter, 0)
    res = {"args": vars(a), "versions": gdn.versions(), "gdn": gdn.install("auto", M._parts(model)[0].config, dev)}
    eng = Eng(model)
    turns = make_episodes(4, 4, 16, 64, arch["hidden_size"], arch["vocab_size"], eng.scale, 4,
                          **({} if a.width == "27b" else {"prompt": 300, "obs": 32}))
    idx = list(range(len(turns.rows)))

    def save():
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))

    batch_s: list[float] = []
    orig = SR.functional_cache

    def timed_cache(*args, **kw):  # called once per scheduled forward, before it runs
        sync()
        batch_s.append(time.perf_counter())
        return orig(*args, **kw)

    def run(share: bool, profile: bool = False) -> dict:
        rc = ReplayConfig(share_prefix=share, keep_graph_tokens=0)
        for p_ in model.parameters():
            p_.grad = None
        batch_s.clear()
        sync()
        t0 = time.perf_counter()
        with torch.enable_grad():
            an, q = score_microbatch(eng, turns, idx, 1.0, 0.05, "checkpoint", rc)
        sync()
        t1 = time.perf_counter()
        marks = batch_s + [t1]
        (sum(x.sum() for x in an) + q.sum() * 1e-3).backward()
        sync()
        t2 = time.perf_counter()
        return {"share": share, "forward_s": round(t1 - t0, 3), "backward_s": round(t2 - t1, 3),
                "forwards_s": [round(y - x, 3) for x, y in zip(marks, marks[1:])] if share else None}

    SR.functional_cache = timed_cache
    res["runs"] = []
    for r in range(a.runs):
        for share in (False, True):
            row = run(share) | {"run": r}
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            save()
    nodes = SR.forest(turns.prefixes, turns.rows)
    res["schedule"] = [{"bases": sorted(set(b.bases)), "T": b.T, "rows": len(b.items)} for b in
                       SR.schedule(nodes, [SR.branch_length(z, x) for z, x in zip(turns.thoughts, turns.answers)])]
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        run(True)
    ka = prof.key_averages()
    res["top_cuda"] = [{"name": e.key[:90], "cuda_ms": round(e.device_time_total / 1e3, 2), "calls": e.count}
                       for e in sorted(ka, key=lambda e: -e.device_time_total)[:a.top]]
    res["top_cpu"] = [{"name": e.key[:90], "cpu_self_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count}
                      for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:a.top]]
    res["cuda_total_ms"] = round(sum(e.self_device_time_total for e in ka) / 1e3, 1)
    print(json.dumps({k: res[k] for k in ("cuda_total_ms", "top_cuda", "top_cpu")}), flush=True)
    save()
    return res


if __name__ == "__main__":
    main()
