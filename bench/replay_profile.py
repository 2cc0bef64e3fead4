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
4. The same profile attributed: each kernel to the module whose forward launched it (its path with layer numbers
   as *, innermost module wins) and to the pass -- forward, recompute (a checkpointed forward run again inside
   backward) or backward (the autograd node is matched to the forward op that made it by sequence number) -- so
   the FP32 elementwise time of part 3 gets an owner before anything is optimised.
5. The keep tier's saved tensors per token, by module and dtype (saved_tensors_hooks), beside the allocator's
   count: what makes the graph ~30 MB per token at the 27B width.
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
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], help="which of the four parts to run")
    p.add_argument("--adapter-kernels", choices=["auto", "torch"], default="auto",
                   help="the LoRA/DoRA epilogue (engine/adapter_kernels.py): fused where qualified, or PyTorch's")
    p.add_argument("--checkpoint-keeps", choices=["inputs", "matmuls"], default="inputs",
                   help="replay.checkpoint_keeps: what the checkpoint tier keeps (matmuls: recompute skips the GEMMs)")
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
    full_layers = arch["num_hidden_layers"]
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
    rc = ReplayConfig(keep_graph_tokens=0, checkpoint_keeps=a.checkpoint_keeps)  # every micro-batch: checkpoint tier
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
    if 4 in a.parts:
        turns, plan = case([2 * n], 7)
        run_plan(eng, turns, rc, plan=plan)  # warm, outside the profile
        res["attribution"] = attribute(lambda: run_plan(eng, turns, rc, plan=plan), model, a.top)
        res["attribution"]["tokens"] = sum(turns.lengths())
        print(json.dumps(res["attribution"], indent=1), flush=True)
    if 5 in a.parts:
        turns, plan = case([2 * n], 7)
        res["saved"] = saved_census(eng, turns, rc, model, a.layers, full_layers, 60)
        print(json.dumps(res["saved"], indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


def saved_census(eng, turns, rc, model, layers: int, full_layers: int, top: int) -> dict:
    """What the keep tier's autograd graph holds, per token: every tensor saved for backward (saved_tensors_hooks),
    counted once per storage, parameters left out, attributed to the innermost module whose forward saved it (layer numbers as *), with
    its dtype; beside it what the CUDA allocator holds after the forward. Scaled to the full model's layer count."""
    import torch

    from engine.replay import score_microbatch

    stack: list[str] = []
    hooks = []
    for name, mod in model.named_modules():
        label = _module_label(name)
        def pre(m, args, label=label) -> None:
            stack.append(label)

        def post(m, args, out) -> None:  # returns None: a forward hook's return value would replace the output
            stack.pop()

        hooks.append(mod.register_forward_pre_hook(pre))
        hooks.append(mod.register_forward_hook(post))
    # parameters saved by reference (e.g. the lm_head weight by the chunked log-prob backward) cost no graph memory
    seen: set = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in model.parameters()}
    by: dict = defaultdict(lambda: [0, 0])

    def pack(t):
        try:
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            nbytes = st.nbytes()
        except (RuntimeError, NotImplementedError):
            key, nbytes = (id(t), 0), t.numel() * t.element_size()
        if key not in seen and t.device.type == "cuda":
            seen.add(key)
            k = (stack[-1] if stack else "(outside)", str(t.dtype).replace("torch.", ""))
            by[k][0] += nbytes
            by[k][1] += 1
        return t

    dev = eng.device
    torch.cuda.synchronize(dev)
    m0 = torch.cuda.memory_allocated(dev)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = score_microbatch(eng, turns, list(range(len(turns.rows))), 1.0, 0.05, "keep", rc)
        torch.cuda.synchronize(dev)
        kept = torch.cuda.memory_allocated(dev) - m0
    finally:
        for h in hooks:
            h.remove()
    del out
    tokens = sum(turns.lengths())
    scale = full_layers / layers
    total = sum(v[0] for v in by.values())
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])
    return {"tokens": tokens, "layers": layers, "scaled_to_layers": full_layers,
            "allocator_kept_mb_per_token": round(kept / tokens / 2**20, 3),
            "saved_mb_per_token": round(total / tokens / 2**20, 3),
            "allocator_kept_mb_per_token_full_model": round(kept / tokens / 2**20 * scale, 2),
            "by_module": [{"module": k[0], "dtype": k[1], "kb_per_token": round(v[0] / tokens / 1024, 2),
                           "tensors": v[1]} for k, v in rows[:top]]}


def _module_label(name: str) -> str:
    import re

    return re.sub(r"\.\d+(?=\.|$)", ".*", name) or "(model)"


def attribute(fn, model, top: int, cuda: bool = True) -> dict:
    """Runs fn under torch.profiler with a record_function range per module forward; CUDA kernel time by
    (pass, module, op). Kernels whose launching op has no module range and no autograd node are '(outside)'."""
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    stack: list = []
    hooks = []
    for name, mod in model.named_modules():
        label = "mod::" + _module_label(name)

        def pre(m, args, kwargs=None, label=label):
            rf = record_function(label)
            rf.__enter__()
            stack.append(rf)

        def post(m, args, out, label=label):
            stack.pop().__exit__(None, None, None)

        hooks.append(mod.register_forward_pre_hook(pre))
        hooks.append(mod.register_forward_hook(post))
    from torch.utils.checkpoint import set_checkpoint_early_stop

    try:  # early stop would end a recompute by an exception, leaving its forward ranges open
        with set_checkpoint_early_stop(False), profile(
                activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU] if cuda else [ProfilerActivity.CPU],
                record_shapes=True) as prof:
            fn()
    finally:
        for h in hooks:
            h.remove()
    events = prof.events()

    def owner(ev):
        """(module label, inside an autograd node?) of the nearest enclosing ranges."""
        mod, node = None, None
        e = ev
        while e is not None:
            if mod is None and e.name.startswith("mod::"):
                mod = e.name[5:]
            if node is None and e.name.startswith("autograd::engine::evaluate_function"):
                node = e
            e = e.cpu_parent
        return mod, node

    fwd_module: dict[int, str] = {}
    for ev in events:
        if ev.device_type == torch.autograd.DeviceType.CPU and getattr(ev, "sequence_nr", -1) >= 0:
            mod, node = owner(ev)
            if node is None and mod is not None:
                fwd_module.setdefault(ev.sequence_nr, mod)
    by: dict = defaultdict(lambda: [0.0, 0])
    shapes: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))  # key -> input shapes/dtypes -> [us, calls]
    per_pass: dict = defaultdict(float)
    per_module: dict = defaultdict(float)
    total = 0.0
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        if cuda:
            if not ev.kernels or any(c.kernels for c in ev.cpu_children):
                continue  # counted at the innermost op that launched them
            us = sum(k.duration for k in ev.kernels)
        else:  # a CPU check of the attribution itself: leaf ops' CPU time
            if ev.cpu_children or ev.name.startswith(("mod::", "autograd::")):
                continue
            us = ev.self_cpu_time_total
        mod, node = owner(ev)
        if node is None:
            kind = "forward" if mod else "(outside)"
        elif mod is not None:
            kind = "recompute"
        else:
            kind = "backward"
            seq = -1
            e = ev
            while e is not None and seq < 0:
                seq = getattr(e, "sequence_nr", -1)
                e = e.cpu_parent
            mod = fwd_module.get(seq, "(node " + node.name.split(": ")[-1] + ")")
        key = (kind, mod or "(outside)", ev.name)
        by[key][0] += us
        by[key][1] += len(ev.kernels) if cuda else 1
        sig = str([list(x) for x in (ev.input_shapes or [])]) + " " + str(getattr(ev, "input_dtypes", "") or "")
        shapes[key][sig][0] += us
        shapes[key][sig][1] += 1
        per_pass[kind] += us
        per_module[(kind, mod or "(outside)")] += us
        total += us
    top_ops = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    top_mod = sorted(per_module.items(), key=lambda kv: -kv[1])[:top]
    return {"kernel_ms_attributed": round(total / 1e3, 1),
            "per_pass_ms": {k: round(v / 1e3, 1) for k, v in per_pass.items()},
            "per_module_ms": [{"pass": k[0], "module": k[1], "ms": round(v / 1e3, 2)} for k, v in top_mod],
            "top_ops": [{"pass": k[0], "module": k[1], "op": k[2][:120], "ms": round(v[0] / 1e3, 2), "kernels": v[1],
                          "inputs": [{"shapes_dtypes": sig[:200], "ms": round(u[0] / 1e3, 2), "calls": u[1]}
                                     for sig, u in sorted(shapes[k].items(), key=lambda kv: -kv[1][0])[:3]]}
                        for k, v in top_ops]}


if __name__ == "__main__":
    main()
