"""Where a later turn's per-row prefill spends its time (engine.prefix_cache.prefill_rows at the 27B shape).

    python bench/prefill_profile.py --base nf4 --out bench/results/h200-prefill-profile-nf4.json   # on the GPU
    python bench/prefill_profile.py --small                                                       # CPU flow check

A later model turn prefills each row alone from its stored prefix (the GRPO group's prompt c_0, `--prompt` tokens)
through the new tokens of the turn (answer + tool result, `--new` tokens): at the recipe shape the pipeline measured
~0.6 s per row and engine on the H200 (bench/results/h200-step-27b-g1-fused-2026-12-01.json: 2.6 s for 4 rows),
for ~215 tokens of a 27B model whose weights take ~15 ms to read. Printed and written as JSON, per row:
    peft      PEFT's own forward (the DoRA norm ||W + s·BA|| recomputed on every forward)
    frozen    engine.cuda_graphs.FrozenAdapter (the norm once per adapter version: what the pipeline runs)
    profile   one frozen row under torch.profiler: wall vs the sum of CUDA kernel time (host-bound when the kernels
              are a small share), kernel launches, the top host ops and kernels
    batched   the same new tokens of all rows as one batch-`--rows` forward from an empty cache vs `--rows` single-row
              forwards from an empty cache (what batching the rows would buy, without the restored prefix)
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
    p.add_argument("--base", choices=["bf16", "nf4"], default="nf4")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--prompt", type=int, default=3072)
    p.add_argument("--new", type=int, default=215)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--small", action="store_true", help="the tiny arch on the CPU (flow check)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from configs.schema import load_config
    from engine import cuda_graphs as CG
    from engine import gdn, nf4
    from engine import model as M
    from engine import prefix_cache as PC
    from recipe_27b import build_random, timed, with_adapter

    cfg27 = load_config("qwen35-27b")
    if a.small:
        arch, dev, dtype = dict(load_config("tiny").model.arch), torch.device("cpu"), torch.float32
        arch["vocab_size"] = 512
        a.prompt, a.new = min(a.prompt, 64), min(a.new, 16)
    else:
        arch, dev, dtype = dict(cfg27.model.arch), torch.device("cuda"), torch.bfloat16
    if a.layers:
        kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        arch["num_hidden_layers"] = a.layers
        arch["layer_types"] = [kinds[i % 4] for i in range(a.layers)]
    res: dict = {"args": vars(a), "torch": torch.__version__, "versions": gdn.versions()}
    base, res["build_s"] = timed(dev, lambda: build_random(arch, arch["vocab_size"], dev, dtype, 0))
    if a.base == "nf4" and dev.type == "cuda":
        _, res["quantize_s"] = timed(dev, lambda: nf4.quantize_nf4_(base))
    model = with_adapter(base, cfg27.adapter, 0)
    res["gdn"] = gdn.install("auto", M._parts(model)[0].config, dev)
    frozen = CG.FrozenAdapter(model)

    g = torch.Generator().manual_seed(0)
    rnd = lambda n: torch.randint(10, arch["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    c0 = rnd(a.prompt)
    rows = [c0 + rnd(a.new) for _ in range(a.rows)]
    bounds = [[len(c0)] for _ in rows]

    def fill(use_frozen: bool) -> float:
        """Seconds of the rows' prefill from a cache that holds c_0 (the later turn's situation)."""
        cache = PC.PrefixCache(40 << 30)
        with torch.no_grad(), frozen:
            PC.prefill_rows(model, [c0], cache)
        if use_frozen:
            with torch.no_grad(), frozen:
                _, s = timed(dev, lambda: PC.prefill_rows(model, rows, cache, bounds))
        else:
            with torch.no_grad():
                _, s = timed(dev, lambda: PC.prefill_rows(model, rows, cache, bounds))
        assert cache.computed_tokens == a.prompt + a.rows * a.new, cache.counters()
        return s

    fill(True)  # warm-up: kernels compiled / autotuned, allocator grown
    res["rows_s"] = {"frozen": fill(True), "peft": fill(False), "frozen_again": fill(True)}
    res["per_row_s"] = {k: round(v / a.rows, 4) for k, v in res["rows_s"].items()}
    print(f"prefill of {a.rows} rows x {a.new} new tokens after a stored {a.prompt}-token prefix: "
          + ", ".join(f"{k} {v:.3f}s" for k, v in res["rows_s"].items()), flush=True)

    # one row under the profiler
    cache = PC.PrefixCache(40 << 30)
    with torch.no_grad(), frozen:
        PC.prefill_rows(model, [c0], cache)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            PC.prefill_rows(model, rows[:1], cache, bounds[:1])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    kern = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU]
    res["profile_one_row"] = {
        "wall_s_profiled": round(wall, 4),
        "cuda_kernel_s": round(sum(e.self_device_time_total for e in kern) / 1e6, 4),
        "kernel_launches": sum(e.count for e in kern),
        "top_kernels": [{"name": e.key[:90], "ms": round(e.self_device_time_total / 1e3, 3), "calls": e.count}
                        for e in sorted(kern, key=lambda e: -e.self_device_time_total)[:15]],
        "top_host_ops": [{"name": e.key[:90], "self_ms": round(e.self_cpu_time_total / 1e3, 3), "calls": e.count}
                         for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:20]],
    }
    pr = res["profile_one_row"]
    print(f"one row profiled: wall {pr['wall_s_profiled']:.3f}s, CUDA kernels {pr['cuda_kernel_s']:.3f}s in "
          f"{pr['kernel_launches']} launches", flush=True)
    for e in pr["top_host_ops"][:12]:
        print(f"  host {e['self_ms']:9.2f} ms  x{e['calls']:<6} {e['name']}")
    for e in pr["top_kernels"][:8]:
        print(f"  cuda {e['ms']:9.2f} ms  x{e['calls']:<6} {e['name']}")

    # batching the rows (no restored prefix: what one batch-B forward costs against B single-row ones)
    text = M._parts(model)[0]
    new = torch.tensor([r[len(c0):] for r in rows], device=dev)

    def single():
        for i in range(a.rows):
            text(input_ids=new[i:i + 1], use_cache=False)

    def batched():
        text(input_ids=new, use_cache=False)

    with torch.no_grad(), frozen:
        single(), batched()
        _, s1 = timed(dev, single)
        _, sb = timed(dev, batched)
    res["batched"] = {"single_rows_s": round(s1, 4), "one_batch_s": round(sb, 4), "ratio": round(s1 / sb, 2)}
    print(f"{a.rows} single-row forwards of {a.new} tokens {s1:.3f}s vs one batch {sb:.3f}s ({s1 / sb:.2f}x)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
