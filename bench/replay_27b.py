"""Replay at the Qwen3.5-27B text shape on one GPU: tiers, throughput, MFU, the preflight's estimate vs the peak.

    python bench/replay_27b.py --tokens 8192 --shapes 4x4 16x4 --gradcheck-layers 4 --out F.json

Model: random weights of the 27B text shape (BF16 base, 64 layers = 48 GDN + 16 attention, hidden 5120, vocabulary
248,320), DoRA r16 on the 10 default targets with FP32 masters (non-zero B), GDN kernels chosen by engine/gdn.py.
Scoring and backward go through the project's own functions: engine.replay.score_microbatch (lean adapter backward,
chunked log-probs, the tier's checkpointing) and stages.optimize.accumulate_gradients (Σ w·logp per micro-batch;
two-pass micro-batches re-forwarded and checked bit for bit).

1. One turn of --tokens tokens (16 thoughts, 64 answer tokens) per tier: seconds for score + backward, tokens/s,
   peak GB, MFU (with --lora-products fp32 split: the lean forward's rank-r product both ways, side by side).
   FLOPs counted: forward 2·P·T (P = matmul parameters of the decoder and the LM head rows used) plus
   causal attention 2·T²·(q heads·head_dim) per attention layer; backward of a frozen base computes input gradients
   only: the same again (no weight-gradient matmuls; LoRA's are negligible); checkpointing and two-pass re-run the
   forward, which is counted as time, not as useful FLOPs. Peak rate: 989 TFLOP/s (H200 dense BF16).
2. Recipe shapes ROWSxTURNS (3,072-token prompt, each turn adds 64 answer + 128 tool tokens): the preflight's plan
   (tiers, estimated peak from token costs measured on this GPU) against the peak measured while the plan runs;
   with --share-prefix off on, replayed per turn and over shared prefixes (engine/shared_replay.py) side by side:
   tokens/s counts the turns' tokens in both (the work a step asks for), forwarded_tokens what each path ran.
3. Gradient equivalence at the 27B width with --gradcheck-layers layers: BF16 base + FP32 masters through the
   pipeline (every tier, prefix-shared, and the checkpoint tier with replay.lora_product: split) against the same weights in FP32 through PEFT's forward (gate: relative
   L2 <= 0.002); and the prefix-shared path in FP32 (the chosen GDN kernels continuing from states with gradients)
   against that reference, where only the chunking differs.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PEAK_FLOPS = 989e12
PAD, EOS, THINK, ANSWER_OPEN = 0, 1, 2, 3


def Eng(model):
    """The trainer role (engine.runtime.Engine) around the bench's model."""
    from engine import model as M
    from engine.runtime import Engine

    return Engine(model=model, toks=M.Tokens(PAD, EOS, THINK, ANSWER_OPEN), scale=M.embed_scale(model))


def make_turns(lengths_prefix: list[int], K: int, L: int, d: int, vocab: int, scale: float, seed: int):
    import torch

    from engine.replay import Turns

    g = torch.Generator().manual_seed(seed)
    base = torch.randint(4, vocab, (max(lengths_prefix),), generator=g).tolist()
    prefixes = [base[:n] for n in lengths_prefix]  # a group shares its prompt; turns extend it
    answers = [torch.randint(4, vocab, (L,), generator=g).tolist() for _ in lengths_prefix]
    thoughts = [torch.randn(K, d, generator=g) * scale for _ in lengths_prefix]
    return Turns(prefixes, thoughts, answers, list(range(len(lengths_prefix))))


def make_episodes(rows: int, n_turns: int, K: int, L: int, d: int, vocab: int, scale: float, seed: int,
                  prompt: int = 3072, obs: int = 128):
    """A recipe-shaped group as the gym stores it: the rows share the prompt; each row's turn t+1 prefix is its turn-t
    prefix plus its own answer (L tokens) and tool observation (obs tokens). Turns in (turn, row) order."""
    import torch

    from engine.replay import Turns

    g = torch.Generator().manual_seed(seed)
    c0 = torch.randint(4, vocab, (prompt,), generator=g).tolist()
    ctx = [list(c0) for _ in range(rows)]
    P, Z, A, R = [], [], [], []
    for _ in range(n_turns):
        for r in range(rows):
            a = torch.randint(4, vocab, (L,), generator=g).tolist()
            P.append(list(ctx[r]))
            Z.append(torch.randn(K, d, generator=g) * scale)
            A.append(a)
            R.append(r)
            ctx[r] += a + torch.randint(4, vocab, (obs,), generator=g).tolist()
    return Turns(P, Z, A, R)


def flops(arch: dict, model, T: int, L: int) -> float:
    """Useful FLOPs of one replayed turn: forward + input-gradient backward (see the module docstring)."""
    from engine import model as M

    text, head, _ = M._parts(model)
    import torch

    P = sum(m.in_features * m.out_features for n, m in text.named_modules()
            if (type(m) is torch.nn.Linear or type(m).__name__ == "Linear4bit") and "lora_" not in n)
    n_attn = sum(1 for t in text.config.layer_types if t == "full_attention")
    attn = 2 * T * T * arch["num_attention_heads"] * arch["head_dim"] * n_attn  # QK^T and PV, causal half
    fwd = 2 * P * T + attn + 2 * head.in_features * head.out_features * L
    return 2 * fwd


def run_plan(eng, turns, rc, temperature: float = 1.0, sigma: float = 0.05, plan=None) -> dict:
    """Score every micro-batch in its tier and back-propagate Σ w·logp, as the replay and optimize stages do."""
    import torch

    from engine.replay import plan_for, score_microbatch
    from stages.optimize import accumulate_gradients

    dev = eng.device
    if plan is None:
        plan = plan_for(eng, turns, rc, temperature, sigma)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    live, lp_turn = [], [None] * len(turns.rows)
    for idx, tier in zip(plan.microbatches, plan.tiers):
        with torch.set_grad_enabled(tier != "two_pass"):
            a, q = score_microbatch(eng, turns, idx, temperature, sigma, tier, rc)
        live.append((idx, a, q) if tier != "two_pass" else None)
        for n, i in enumerate(idx):
            lp_turn[i] = torch.cat([q[n].detach().float(), a[n].detach().float()]).cpu()
    torch.cuda.synchronize(dev)
    t1 = time.perf_counter()

    class Cfg:
        sampler = type("S", (), {"temperature": temperature})()
        replay = rc

    class LI:
        pass

    li = LI()
    li.turns, li.sigma, li.lp_turn = turns, sigma, lp_turn
    K = turns.thoughts[0].shape[0]
    wq = [torch.full((K,), 1e-3) for _ in turns.rows]
    wa = [torch.linspace(-1, 1, len(a)) for a in turns.answers]
    accumulate_gradients(Cfg, eng, li, wq, wa, live=live, plan=(plan.microbatches, plan.tiers))
    del live
    torch.cuda.synchronize(dev)
    t2 = time.perf_counter()
    return {"score_s": round(t1 - t0, 3), "backward_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3),
            "peak_gb": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2), "plan": plan.summary(),
            "tokens": sum(turns.lengths())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[8192])
    p.add_argument("--tiers", nargs="+", default=["two_pass", "checkpoint", "keep"])
    p.add_argument("--shapes", nargs="*", default=["4x4"], help="ROWSxTURNS recipe shapes for the preflight check")
    p.add_argument("--gradcheck-layers", type=int, default=0)
    p.add_argument("--gradcheck-bases", nargs="+", default=["bf16"], choices=["bf16", "nf4"])
    p.add_argument("--only-gradcheck", action="store_true", help="skip parts 1 and 2 (no full-size model)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick checks)")
    p.add_argument("--gdn", default="auto", choices=["auto", "torch", "fla"])
    p.add_argument("--probe-tokens", type=int, default=512)
    p.add_argument("--base", choices=["bf16", "nf4"], default="bf16", help="nf4: bitsandbytes NF4 base, as the 27B step")
    p.add_argument("--adapter-kernels", nargs="+", choices=["auto", "torch"], default=["auto"],
                   help="the LoRA/DoRA epilogue per pass of part 1 (engine/adapter_kernels.py); several: side by side")
    p.add_argument("--norm-kernels", nargs="+", choices=["auto", "torch"], default=["auto"],
                   help="the RMSNorms per pass of part 1 (engine/norm_kernels.py: fused where qualified, or "
                        "transformers' expressions); several: side by side")
    p.add_argument("--checkpoint-keeps", nargs="+", choices=["inputs", "matmuls"], default=["inputs"],
                   help="replay.checkpoint_keeps of the checkpoint and two-pass tiers in part 1; several: side by side")
    p.add_argument("--lora-products", nargs="+", choices=["fp32", "split"], default=["fp32"],
                   help="replay.lora_product of part 1 (the lean forward's h = A x: FP32 copy + FP32 GEMM, or one "
                        "BF16 tensor-core GEMM of A's split halves); several: side by side")
    p.add_argument("--share-prefix", nargs="+", choices=["off", "on"], default=["off"],
                   help="replay.share_prefix of part 2 (engine/shared_replay.py); both: side by side, with the "
                        "gradients' relative L2 between them")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch

    from configs.schema import ReplayConfig, load_config
    from engine import adapter_kernels as AK
    from engine import gdn
    from engine import model as M
    from engine import norm_kernels as NK
    from engine.replay import ReplayMemoryError
    from recipe_27b import build_random, with_adapter

    dev = torch.device("cuda")
    cfg27 = load_config("qwen35-27b")
    arch = dict(cfg27.model.arch)
    if a.only_gradcheck:
        res = {"args": vars(a), "versions": gdn.versions(), "gradcheck": {}}
        for b in a.gradcheck_bases:
            res["gradcheck"][b] = gradcheck(arch, cfg27, a.gradcheck_layers, dev, b)
            print(json.dumps(res["gradcheck"][b]), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
        return res
    if a.layers:
        kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        arch.update(num_hidden_layers=a.layers, layer_types=[kinds[i % 4] for i in range(a.layers)])
    vocab = arch["vocab_size"]
    res: dict = {"args": vars(a), "versions": gdn.versions()}
    t = time.perf_counter()
    base = build_random(arch, vocab, dev, torch.bfloat16, 0)
    if a.base == "nf4":
        from engine.nf4 import quantize_nf4_

        res["quantized_layers"] = quantize_nf4_(base)
        torch.cuda.empty_cache()
    model = with_adapter(base, cfg27.adapter, 0)
    res["build_s"] = round(time.perf_counter() - t, 1)
    res["adapter_epilogue"] = AK.install(a.adapter_kernels[0], dev)
    res["gdn"] = gdn.install(a.gdn, M._parts(model)[0].config, dev)
    res["norms"] = NK.install(a.norm_kernels[0], dev)
    eng = Eng(model)
    d = arch["hidden_size"]
    res["resident_gb"] = round(torch.cuda.memory_allocated(dev) / 2**30, 2)

    # 0. per-token costs of the tiers on this GPU (what the preflight plans with) --------------------------------------
    from engine.replay import measure_costs

    probe = make_turns([1000], 16, 64, d, vocab, eng.scale, 1)
    costs = {}
    for keeps in dict.fromkeys(["inputs", *a.checkpoint_keeps]):
        t = time.perf_counter()
        costs[keeps] = measure_costs(eng, probe, ReplayConfig(checkpoint_keeps=keeps), 1.0, 0.05,
                                     probe_tokens=a.probe_tokens)
        res.setdefault("token_costs_by_checkpoint_keeps", {})[keeps] = costs[keeps].as_dict() | {
            "measure_s": round(time.perf_counter() - t, 1), "probe_tokens": a.probe_tokens}
    eng._replay_costs = costs["inputs"]
    res["token_costs"] = res["token_costs_by_checkpoint_keeps"]["inputs"]
    print(json.dumps(res["token_costs_by_checkpoint_keeps"]), flush=True)

    # 1. one long turn per tier ---------------------------------------------------------------------------------------
    res["turns"] = []
    cases = [(T, k, nk, tier, keeps, lp) for T in a.tokens for k in a.adapter_kernels for nk in a.norm_kernels
             for tier in a.tiers for keeps in (a.checkpoint_keeps if tier != "keep" else ["inputs"])
             for lp in a.lora_products]
    for T, kernels, nk, tier, keeps, lp in cases:
        turns = make_turns([T - 16 - 64 - 1], 16, 64, d, vocab, eng.scale, T)
        F = flops(arch, model, T, 64)
        epilogue = AK.install(kernels, dev)
        norms = NK.install(nk, dev)
        caps = {"keep": {}, "checkpoint": {"keep_graph_tokens": 0},
                "two_pass": {"keep_graph_tokens": 0, "checkpoint_tokens": 0}}[tier]
        rc = ReplayConfig(**caps, checkpoint_keeps=keeps, lora_product=lp)
        eng._replay_costs = costs[keeps]
        row = {"T": T, "tier": tier, "checkpoint_keeps": keeps, "lora_product": lp, "adapter_kernels": kernels,
               "epilogue": epilogue, "norm_kernels": nk, "norms": norms}
        try:
            from engine.replay import plan_for

            plan = plan_for(eng, turns, rc, 1.0, 0.05)
            if plan.tiers != [tier]:
                row["skipped"] = f"the preflight plans {plan.tiers} here (the tier does not fit)"
            else:
                run_plan(eng, turns, rc, plan=plan)  # warm-up (kernel autotuning, allocator)
                r = run_plan(eng, turns, rc, plan=plan)
                row.update(r, tokens_per_s=round(T / r["total_s"], 1),
                           mfu=round(F / r["total_s"] / PEAK_FLOPS, 4), useful_tflop=round(F / 1e12, 2),
                           est_peak_gb=r["plan"].get("est_peak_gb"))
        except (ReplayMemoryError, torch.OutOfMemoryError) as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        gc.collect()
        torch.cuda.empty_cache()
        row["allocated_after_gb"] = round(torch.cuda.memory_allocated(dev) / 2**30, 2)
        res["turns"].append(row)
        print(json.dumps(row), flush=True)

    # 2. recipe shapes: preflight estimate vs measured peak -----------------------------------------------------------
    AK.install(a.adapter_kernels[0], dev)
    NK.install(a.norm_kernels[0], dev)
    eng._replay_costs = costs["inputs"]
    res["shapes"] = []
    params = [p_ for p_ in model.parameters() if p_.requires_grad]
    for shape in a.shapes:
        rows, n_turns = map(int, shape.split("x"))
        turns = make_episodes(rows, n_turns, 16, 64, d, vocab, eng.scale, rows)
        grads = {}
        for share in a.share_prefix:
            row = {"shape": shape, "rows": rows, "turns": n_turns, "share_prefix": share}
            rc = ReplayConfig(share_prefix=share == "on")
            try:
                for p_ in params:
                    p_.grad = None
                if len(a.share_prefix) > 1:  # side by side: a warm-up run first (autotuning, allocator)
                    run_plan(eng, turns, rc)
                    for p_ in params:
                        p_.grad = None
                r = run_plan(eng, turns, rc)
                grads[share] = [p_.grad.detach().float().clone() for p_ in params]
                est = r["plan"].get("est_peak_gb")
                forwarded = sum(r["plan"]["tier_tokens"].values())
                row.update(r, forwarded_tokens=forwarded, tokens_per_s=round(r["tokens"] / r["total_s"], 1),
                           forwarded_tokens_per_s=round(forwarded / r["total_s"], 1),
                           est_vs_measured=None if est is None else round(est / r["peak_gb"], 3))
            except (ReplayMemoryError, torch.OutOfMemoryError) as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            gc.collect()
            torch.cuda.empty_cache()
            res["shapes"].append(row)
            print(json.dumps(row), flush=True)
            if a.out:  # what is done so far survives a later part's failure
                Path(a.out).write_text(json.dumps(res, indent=1))
        if len(grads) == 2:  # the two paths' BF16 gradients against each other (the FP32 gate: part 3)
            num = sum(float((x - y).pow(2).sum()) for x, y in zip(grads["on"], grads["off"])) ** 0.5
            den = sum(float(y.pow(2).sum()) for y in grads["off"]) ** 0.5
            res["shapes"][-1]["grad_rel_l2_vs_off"] = num / den
            print(json.dumps({"shape": shape, "grad_rel_l2_on_vs_off": num / den}), flush=True)
        del grads

    # 3. gradient equivalence at the 27B width, few layers ------------------------------------------------------------
    if a.gradcheck_layers:
        del model, eng
        torch.cuda.empty_cache()
        res["gradcheck"] = {b: gradcheck(arch, cfg27, a.gradcheck_layers, dev, b) for b in a.gradcheck_bases}
        print(json.dumps(res["gradcheck"]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


def gradcheck(arch: dict, cfg27, layers: int, dev, base: str = "bf16") -> dict:
    """base bf16: the BF16 base against the same values in FP32. base nf4: an NF4 base (bitsandbytes Linear4bit,
    the trainer's) against its dequantized weights in FP32 -- the arithmetic is compared, not the quantization."""
    import torch

    from configs.schema import ReplayConfig
    from engine.replay import score_microbatch
    from recipe_27b import build_random, with_adapter
    from stages.gradcheck import compare

    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    arch = dict(arch, num_hidden_layers=layers, layer_types=[kinds[i % 4] for i in range(layers)])
    vocab = arch["vocab_size"]
    adapter_keys = ("lora_", "magnitude")
    if base == "nf4":
        from engine.nf4 import iter_bf16_state, quantize_nf4_

        nf_base = build_random(arch, vocab, dev, torch.bfloat16, 0)
        quantize_nf4_(nf_base)
        deq = {k: v.float() for k, v in iter_bf16_state(nf_base)}
        ref_base = build_random(arch, vocab, dev, torch.float32, 0, init=False)
        missing, unexpected = ref_base.load_state_dict(deq, strict=False)
        if unexpected or [k for k in missing if "rotary" not in k]:
            raise RuntimeError(f"NF4 gradcheck: state mismatch {missing[:4]} {unexpected[:4]}")
        bf = with_adapter(nf_base, cfg27.adapter, 0)
        ref_model = with_adapter(ref_base, cfg27.adapter, 0)
        ref_model.load_state_dict({k: v.float() for k, v in bf.state_dict().items()
                                   if any(a in k for a in adapter_keys)}, strict=False)  # identical FP32 masters
    else:
        ref_model = with_adapter(build_random(arch, vocab, dev, torch.float32, 0), cfg27.adapter, 0)
        bf = with_adapter(build_random(arch, vocab, dev, torch.bfloat16, 0, init=False), cfg27.adapter, 1)
        bf.load_state_dict({k: v.to(torch.bfloat16) if not any(a in k for a in adapter_keys) else v
                            for k, v in ref_model.state_dict().items()})
        ref_model.load_state_dict({k: (v.float() if any(a in k for a in adapter_keys) else
                                       v.to(torch.bfloat16).float()) for k, v in ref_model.state_dict().items()})
    eng_ref, eng_bf = Eng(ref_model), Eng(bf)
    turns = make_turns([1500, 1800, 2100, 2400], 16, 64, arch["hidden_size"], vocab, eng_ref.scale, 5)
    turns.rows = [0, 0, 0, 0]  # one row's four turns: each prefix extends the last (prefix-shared replay chains them)
    wq = [torch.full((16,), 1e-3, device=dev) for _ in turns.rows]
    wa = [torch.linspace(-1, 1, 64, device=dev) for _ in turns.rows]
    for p_ in ref_model.parameters():
        p_.grad = None
    idx = list(range(len(turns.rows)))
    from engine import gdn

    chosen = gdn.chosen()
    gdn.install("torch", ref_model.config, dev)  # the reference: PyTorch GDN in FP32
    with torch.enable_grad():  # FP32 everything, PEFT's forward, full log-softmax, one batch
        a, q = score_microbatch(eng_ref, turns, idx, 1.0, 0.05)
        sum((wa[n] * a[n]).sum() + (wq[n] * q[n]).sum() for n in idx).backward()
    ref = {n: p_.grad.double().cpu() for n, p_ in ref_model.named_parameters() if p_.requires_grad}
    gdn.install("fla" if chosen.get("chunk") == "fla" else "torch", ref_model.config, dev)
    out = {"base": base, "layers": layers, "tokens": sum(turns.lengths()), "gdn": gdn.chosen()}
    # prefix-shared replay in FP32 (the chosen GDN kernels continuing chunks from states with gradients) against the
    # per-turn FP32 reference: only the chunking differs
    for p_ in ref_model.parameters():
        p_.grad = None
    run_plan(eng_ref, turns, ReplayConfig(share_prefix=True))
    got = {n: p_.grad.double().cpu() for n, p_ in ref_model.named_parameters() if p_.requires_grad}
    c = compare(got, ref)
    out["share_prefix_fp32_vs_fp32"] = {k: c[k] for k in ("rel_l2", "tensors", "tensors_outside",
                                                          "worst_tensor_rel_l2", "passed")}
    # the same BF16 base through PEFT's own forward/autograd, every turn in one batch, no memory policy: isolates
    # what the tiers, micro-batching, the lean adapter backward and the chunked log-probs change
    for p_ in bf.parameters():
        p_.grad = None
    with torch.enable_grad():
        a, q = score_microbatch(eng_bf, turns, idx, 1.0, 0.05)
        sum((wa[n] * a[n]).sum() + (wq[n] * q[n]).sum() for n in idx).backward()
    ref_bf = {n: p_.grad.double().cpu() for n, p_ in bf.named_parameters() if p_.requires_grad}
    out["peft_bf16_vs_fp32"] = {k: v for k, v in compare(ref_bf, ref).items() if k != "outside"}
    for tier, caps in (("keep", {}), ("checkpoint", {"keep_graph_tokens": 0}),
                       ("two_pass", {"keep_graph_tokens": 0, "checkpoint_tokens": 0}),
                       ("share_prefix_checkpoint", {"keep_graph_tokens": 0, "share_prefix": True}),
                       ("checkpoint_split_product", {"keep_graph_tokens": 0, "lora_product": "split"})):
        for p_ in bf.parameters():
            p_.grad = None
        run_plan(eng_bf, turns, ReplayConfig(microbatch_tokens=4096 if "share_prefix" not in caps else 16384, **caps))
        got = {n: p_.grad.double().cpu() for n, p_ in bf.named_parameters() if p_.requires_grad}
        keys = ("rel_l2", "tensors", "tensors_outside", "worst_tensor_rel_l2", "passed")
        c, cb = compare(got, ref), compare(got, ref_bf)
        out[tier] = {"vs_fp32": {k: c[k] for k in keys}, "vs_peft_bf16_one_batch": {k: cb[k] for k in keys}}
    return out


if __name__ == "__main__":
    main()
