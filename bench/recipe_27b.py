"""The recipe's shape (docs/architecture.md) on one GPU: a random-weight model of the Qwen3.5-27B text shape, one GRPO group.

    python bench/recipe_27b.py --base bf16|nf4 --turns 4 --prompt-tokens 3072 --thoughts 16 \\
        --answer-tokens 64 --tool-tokens 128 --out results.json
    python bench/recipe_27b.py --small ...      # the tiny arch on the CPU (eager static path): checks the flow

One group of `--rows` rollouts shares a random prompt c_0; every turn, per row:
    prefill  the latent loop's model (--latent-engine, as configs' latent.engine: the sampler's BF16 export for
             NF4, the trainer otherwise): engine.prefix_cache.prefill_rows (each row alone from its longest stored
             prefix, turn boundaries) -- and the sampler's prefill of the same prefix (the same cache when the
             latent loop runs on the sampler or both hold the same weights: then it only restores the rows)
    latent   GraphedLatentLoop.run_rows: <think> + K-1 thoughts on the static cache, CUDA-graph replay
    answers  GraphedDecoder.sample_rows: <think> ⊕ z ⊕ </think> chunk, then exactly --answer-tokens tokens
    gym      c_{t+1} = c_t ⊕ answer ⊕ --tool-tokens random tool-result ids (no tool runs: ~0 s)
Trainer = base + DoRA adapter (configs/qwen35-27b.yaml: r16, FP32 masters, random non-zero B). NF4: the trainer's
base is bitsandbytes NF4 and the sampler is the BF16 export of its dequantized weights (checked bit for bit), or with
--sampler trainer the NF4 trainer itself (one 80 GB GPU; every single-token step then takes engine/nf4_kernels.py).
--compare-layout FILE times the graphed latent step and decoded token again under another layout, on the same rows.
PEFT layers run with engine.cuda_graphs.FrozenAdapter (DoRA scale computed once per adapter version, PEFT's
arithmetic bit for bit) in every phase.

Printed and written as JSON: per-phase seconds per turn, generation seconds per model turn (prefill + latent +
answers), latent ms/step (eager HF dynamic cache with PEFT's own forward, eager static, graphed replay) and decode
ms/token (eager static, graphed; CUDA and CPU generator) at the group's batch, next to the HBM floor (bytes a step
reads / 4.8 TB/s), the prefix cache's computed share, and cached vs uncached last-position logits. Targets (not
gates): latent step <= 15 ms, decode <= 13 ms/token, computed share <= 10 % with logits within 1e-3, generation
<= 1.5 s per model turn.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

HBM_BYTES_PER_S = 4.8e12  # the floors' yardstick: main() sets the running card's (bench.kernel_sweep.hbm_tb_per_s)
PAD, EOS, THINK, ANSWER_OPEN = 0, 1, 2, 3


def sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev, fn):
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t


# ----------------------------------------------------------------------------------------------------------------
# model


def build_random(arch: dict, vocab: int, device, dtype, seed: int, std: float = 0.02, init: bool = True):
    """Qwen3_5ForCausalLM on `device` with random weights (engine.model.build_random_on)."""
    from engine.model import build_random_on

    return build_random_on(arch, vocab, PAD, EOS, seed, dtype, device, std, init)


def with_adapter(model, adapter_cfg, seed: int):
    import torch

    from engine import model as M

    torch.manual_seed(seed)
    peft_model = M.attach_adapter(model, adapter_cfg)
    g = torch.Generator(device=next(peft_model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1e-3, generator=g)
    return peft_model.eval()


def weight_bytes(model) -> int:
    """Bytes one decode step reads: NF4 codes + absmax (+ nested stats) of the quantized layers, and every other
    parameter except the input embedding table (only B rows of it are read per step), adapters included."""
    from engine.nf4 import _base, _is_linear4bit

    base = _base(model)
    total = 0
    emb = base.model.embed_tokens.weight
    for _, mod in base.named_modules():
        if _is_linear4bit(mod):
            qs = mod.weight.quant_state
            total += mod.weight.data.numel() * mod.weight.data.element_size()
            total += qs.absmax.numel() * qs.absmax.element_size()
            if getattr(qs, "state2", None) is not None:
                total += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
            continue
        total += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False) if p is not emb)
    return total


# ----------------------------------------------------------------------------------------------------------------
# the run


def apply_layouts(path: str) -> dict:
    """Set engine.attention_kernels.CONFIG / engine.nf4_kernels.CONFIG from a kernel_sweep JSON's best layouts."""
    from engine import attention_kernels, nf4_kernels

    sweep = json.loads(Path(path).read_text())
    applied = {}
    for name, mod in (("attention", attention_kernels), ("nf4", nf4_kernels)):
        best = (sweep.get(name) or {}).get("best")
        if best:
            unknown = sorted(set(best) - set(mod.CONFIG))
            if unknown:
                raise SystemExit(f"--apply {path}: {name} layout keys {unknown} are not in {mod.__name__}.CONFIG "
                                 f"({sorted(mod.CONFIG)}); was the sweep made by another version?")
            mod.CONFIG.update(best)
            applied[name] = dict(mod.CONFIG)
    return applied


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", choices=["bf16", "nf4"], default="bf16")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=3072)
    p.add_argument("--thoughts", type=int, default=16)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--tool-tokens", type=int, default=128)
    p.add_argument("--eager-steps", type=int, default=3, help="steps of each eager baseline")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick checks)")
    p.add_argument("--small", action="store_true", help="tiny arch on the CPU, eager static path (flow check)")
    p.add_argument("--attention", choices=["gqa", "hf"], default="gqa",
                   help="static-cache attention: grouped (no repeat_kv copies) or the model's own (sdpa)")
    p.add_argument("--profile", action="store_true",
                   help="also: latent replay ms/step with each attention, and a kernel profile of eager static steps")
    p.add_argument("--kernels", choices=["auto", "torch"], default="auto",
                   help="GDN, adapter-epilogue, adapter-step and RMSNorm kernels as the trainer chooses them (engine.runtime.build: "
                        "qualified fused kernels where they pass, one log line otherwise), or PyTorch everywhere")
    p.add_argument("--gdn-step", choices=["auto", "torch"], default="auto",
                   help="the static decoder's one-token GDN step (engine/gdn_step.py): the fused kernel where it "
                        "qualifies, or transformers' forward")
    p.add_argument("--attention-kernels", choices=["auto", "torch"], default=None,
                   help="the decode attention kernels (model.attention_kernels; default: the config's, torch)")
    p.add_argument("--nf4-kernels", choices=["auto", "torch"], default=None,
                   help="the NF4 small-batch kernel (model.nf4_kernels; default: the config's, torch)")
    p.add_argument("--latent-engine", choices=["auto", "trainer", "sampler"], default="auto",
                   help="the model the latent loop runs on (configs latent.engine): auto = the sampler's BF16 export "
                        "for --base nf4 (one prefill per row then serves thoughts and answers), the trainer for bf16")
    p.add_argument("--sampler", choices=["export", "trainer"], default="export",
                   help="--base nf4: the answers' model: the BF16 export of the trainer's weights (+54 GB), or the NF4 "
                        "trainer itself (configs sampler.weights=trainer: one 80 GB GPU; thoughts and answers then "
                        "run the NF4 small-batch kernel)")
    p.add_argument("--apply", nargs="+", default=None, metavar="SWEEP_JSON",
                   help="launch layouts of the decode attention and NF4 kernels from bench/kernel_sweep.py's JSON "
                        "(its 'best' entries; each kernel is qualified again at that layout before use)")
    p.add_argument("--compare-layout", default=None, metavar="SWEEP_JSON",
                   help="also time the graphed latent step and decoded token under this NF4/attention layout "
                        "(graphs captured again on the same rows), side by side with the run's own")
    p.add_argument("--compare-gdn-step", action="store_true",
                   help="also time the graphed latent step and decoded token with the other one-token GDN step "
                        "(engine/gdn_step.py fused vs transformers' forward; graphs captured again on the same rows)")
    p.add_argument("--out", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch

    from configs.schema import load_config
    from engine import cuda_graphs as CG
    from engine import model as M
    from engine import nf4
    from engine import prefix_cache as PC

    t_start = time.perf_counter()

    def say(msg: str) -> None:  # progress on stdout as it happens: a run stopped by a timeout shows where it was
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", flush=True)

    cfg27 = load_config("qwen35-27b")
    if a.small:
        arch = dict(load_config("tiny").model.arch)
        vocab, dev, dtype = 512, torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
    else:
        arch = dict(cfg27.model.arch)
        vocab, dev, dtype = arch["vocab_size"], torch.device("cuda"), torch.bfloat16
    arch["vocab_size"] = vocab
    if a.layers:
        kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        arch["num_hidden_layers"] = a.layers
        arch["layer_types"] = [kinds[i % 4] for i in range(a.layers)]
    graphed = dev.type == "cuda"
    global HBM_BYTES_PER_S
    if graphed:
        from bench.kernel_sweep import hbm_tb_per_s

        HBM_BYTES_PER_S = hbm_tb_per_s(torch.cuda.get_device_name(dev)) * 1e12
    toks = M.Tokens(pad=PAD, eos=EOS, think=THINK, answer_open=ANSWER_OPEN)
    res: dict = {"args": vars(a), "arch": arch, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(dev) if graphed else platform.processor()}
    import transformers

    res["transformers"] = transformers.__version__

    # -- models ------------------------------------------------------------------------------------------------------
    base, res["build_s"] = timed(dev, lambda: build_random(arch, vocab, dev, dtype, a.seed))
    from engine import adapter_kernels, attention_kernels, gdn, gdn_step, nf4_kernels, norm_kernels

    if a.apply:
        res["applied_layouts"] = {}
        for f in a.apply:  # later files win
            res["applied_layouts"].update(apply_layouts(f))
    # the choices engine.runtime.build makes, before the first forward and before any graph is captured
    res["kernels"] = {"gdn": gdn.install(a.kernels, base.config, dev),
                      "gdn_step": gdn_step.install(
                          "torch" if a.kernels == "torch" or a.gdn_step == "torch" else a.kernels, base.config, dev),
                      "adapter_epilogue": adapter_kernels.install(a.kernels, dev),
                      "adapter_step": adapter_kernels.install_step(a.kernels, dev),
                      "rmsnorm": norm_kernels.install(a.kernels, dev),
                      "decode_attention": attention_kernels.install(
                          "torch" if a.kernels == "torch" else a.attention_kernels or cfg27.model.attention_kernels,
                          dev)}
    res["decode_attention_qualification"] = attention_kernels._STATE.get("qualification")
    if a.base == "nf4":
        res["kernels"]["nf4_step"] = nf4_kernels.install(
            "torch" if a.kernels == "torch" else a.nf4_kernels or cfg27.model.nf4_kernels, dev)
        res["nf4_step_qualification"] = nf4_kernels._STATE.get("qualification")
    res["params"] = sum(p_.numel() for p_ in base.parameters())
    acfg = cfg27.adapter
    if a.base == "nf4":
        n, res["quantize_s"] = timed(dev, lambda: nf4.quantize_nf4_(base))
        res["quantized_layers"] = n
    if a.base == "nf4" and a.sampler == "export":
        sampler_base = build_random(arch, vocab, dev, dtype, a.seed + 1, init=False)
        # the export: the trainer's dequantized weights, streamed into the sampler's BF16 copy
        _, res["export_s"] = timed(dev, lambda: nf4.load_state_into(sampler_base, base))
        trainer = with_adapter(base, acfg, a.seed)
        sampler = with_adapter(sampler_base, acfg, a.seed + 7)
        M.load_adapter_state(sampler, M.adapter_state(trainer))
        rep, res["export_check_s"] = timed(dev, lambda: nf4.verify_export(trainer, sampler))
        res["export_equal"] = rep["equal"]
        res["export_check"] = rep
    else:  # one model (a BF16 base, or --sampler trainer): thoughts and answers on the trainer
        trainer = with_adapter(base, acfg, a.seed)
        sampler = trainer
    res["adapter_s"] = round(time.perf_counter() - t_start - res["build_s"], 2)
    say(f"models ready (build {res['build_s']:.1f} s, quantize {res.get('quantize_s', 0):.1f} s, "
        f"export {res.get('export_s', 0):.1f} s)")
    if graphed:
        res["gpu_mem_models_gb"] = round(torch.cuda.memory_allocated(dev) / 1e9, 2)
    engine = a.latent_engine if a.latent_engine != "auto" else (
        "sampler" if a.base == "nf4" and a.sampler == "export" else "trainer")
    thinker = sampler if engine == "sampler" else trainer  # the latent loop's model
    res["latent_engine"] = engine
    scale = M.embed_scale(trainer)
    sigma = cfg27.latent.sigma * scale
    K, A, T, B = a.thoughts, a.answer_tokens, a.tool_tokens, a.rows
    capacity = a.prompt_tokens + a.turns * (A + T) + K + 2 + A + 8
    loop = CG.GraphedLatentLoop(thinker, capacity=capacity, graphed=graphed, profile=True, attention=a.attention)
    dec = CG.GraphedDecoder(sampler, capacity=capacity, graphed=graphed, profile=True, attention=a.attention)
    scache = PC.PrefixCache(40 << 30)
    tcache = scache if thinker is sampler else PC.PrefixCache(40 << 30)  # the latent loop's model's cache
    res["floor_ms"] = {"latent": round(weight_bytes(thinker) / HBM_BYTES_PER_S * 1e3, 2),
                       "sampler": round(weight_bytes(sampler) / HBM_BYTES_PER_S * 1e3, 2)}

    # -- the episode -------------------------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(a.seed)
    rnd = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()  # noqa: E731
    c0 = rnd(a.prompt_tokens)
    prefixes = [list(c0) for _ in range(B)]
    history: list[list[list[int]]] = []
    gen_lat = torch.Generator(device=dev).manual_seed(a.seed + 1)
    gen_smp = torch.Generator(device=dev).manual_seed(a.seed + 2)
    turns = []
    for t in range(a.turns):
        bounds = [[len(h[i]) for h in history] for i in range(B)]
        row = {"turn": t, "prefix_tokens": [len(x) for x in prefixes]}
        tc0 = (tcache.input_tokens, tcache.computed_tokens)
        say(f"turn {t}: prefill for the latent loop ...")
        with loop.frozen:
            rs, row["prefill_latent_s"] = timed(dev, lambda: PC.prefill_rows(thinker, prefixes, tcache, bounds))
        say(f"turn {t}: prefill {row['prefill_latent_s']:.2f} s; latent loop ...")
        row["latent_computed_tokens"] = tcache.computed_tokens - tc0[1]
        row["latent_input_tokens"] = tcache.input_tokens - tc0[0]
        loop.reset_stats()
        (z, lq), row["latent_s"] = timed(dev, lambda: loop.run_rows(rs, K, sigma, scale, toks, gen_lat))
        row["latent_steps"] = dict(loop.stats()["counts"])
        row["latent_times_s"] = {k: round(v, 4) for k, v in loop.stats()["times_s"].items()}
        say(f"turn {t}: latent {row['latent_s']:.2f} s {row['latent_steps']}; prefill for the answers ...")
        with dec.frozen:
            rs2, row["prefill_answers_s"] = timed(dev, lambda: PC.prefill_rows(sampler, prefixes, scache, bounds))
        say(f"turn {t}: answers' prefill {row['prefill_answers_s']:.2f} s; answers ...")
        dec.reset_stats()
        (ids, lps), row["answers_s"] = timed(dev, lambda: dec.sample_rows(rs2, z, A, 1.0, toks, gen_smp,
                                                                          limits=[A] * B))
        row["decode_steps"] = dict(dec.stats()["counts"])
        row["decode_times_s"] = {k: round(v, 4) for k, v in dec.stats()["times_s"].items()}
        row["answer_tokens"] = [len(x) for x in ids]

        def gym():
            history.append([list(x) for x in prefixes])
            for i in range(B):
                ans = ids[i] + rnd(A - len(ids[i]))  # fixed answer length even if a row hit <|im_end|>
                prefixes[i] = prefixes[i] + ans + rnd(T)
        _, row["gym_s"] = timed(dev, gym)
        row["prefill_s"] = row["prefill_latent_s"] + row["prefill_answers_s"]
        row["generation_s"] = row["prefill_s"] + row["latent_s"] + row["answers_s"]
        turns.append(row)
        print(f"turn {t}: prefill {row['prefill_s']:.2f}s (latent model computed {row['latent_computed_tokens']}/"
              f"{row['latent_input_tokens']} tok)  latent {row['latent_s']:.3f}s  answers {row['answers_s']:.3f}s  "
              f"gym {row['gym_s']:.4f}s  -> generation {row['generation_s']:.2f}s", flush=True)
    res["turns"] = turns
    res["phases_s"] = {k: round(sum(r[k] for r in turns), 3) for k in ("prefill_s", "latent_s", "answers_s", "gym_s")}
    steady = turns[1:] if len(turns) > 1 else turns
    res["generation_s_per_turn"] = {"first": round(turns[0]["generation_s"], 3),
                                    "later_mean": round(sum(r["generation_s"] for r in steady) / len(steady), 3)}

    # -- per-step figures at batch B (the last turn's rows) -------------------------------------------------------
    def per(times, counts, key):
        return round(1e3 * times.get(key, 0.0) / counts[key], 2) if counts.get(key) else None

    lat = {"graphed_replay": None, "eager_static": None, "eager_hf_dynamic": None}
    dcd = {"graphed_replay": None, "eager_static": None, "graphed_replay_cpu_generator": None}
    bounds = [[len(h[i]) for h in history] for i in range(B)]
    with loop.frozen:
        rs = PC.prefill_rows(thinker, prefixes, tcache, bounds)
    loop.reset_stats()
    loop.run_rows(rs, K, sigma, scale, toks, gen_lat)
    st = loop.stats()
    mode = "replay" if graphed else "eager"
    lat["graphed_replay" if graphed else "eager_static"] = per(st["times_s"], st["counts"], mode)
    lat["first_call"] = {k: round(v, 4) for k, v in turns[0]["latent_times_s"].items()}
    if graphed:
        eager_loop = CG.GraphedLatentLoop(thinker, capacity=capacity, graphed=False, profile=True,
                                          attention=a.attention)
        eager_loop.frozen = loop.frozen
        eager_loop.run_rows(rs, a.eager_steps, sigma, scale, toks, gen_lat)
        st = eager_loop.stats()
        lat["eager_static"] = per(st["times_s"], st["counts"], "eager")
        del eager_loop
    # eager HF: DynamicCache + PEFT's own forward (no frozen DoRA scale), as engine.prefix_cache decodes
    kv, mask, pos = PC.stack_rows(rs)
    text, _, emb = M._parts(thinker)
    x = emb(torch.full((B, 1), THINK, dtype=torch.long, device=dev))
    ts = []
    with torch.no_grad():
        for _ in range(a.eager_steps):
            (h, mask, pos), dt = timed(dev, lambda: PC._decode_step(text, x, kv, mask, pos))
            ts.append(dt)
            x = h[:, None].to(dtype)
    lat["eager_hf_dynamic"] = round(1e3 * sum(ts[1:] or ts) / len(ts[1:] or ts), 2)
    res["latent_ms_per_step"] = lat

    with dec.frozen:
        rs2 = PC.prefill_rows(sampler, prefixes, scache, bounds)
    dec.reset_stats()
    dec.sample_rows(rs2, z, A, 1.0, toks, gen_smp, limits=[A] * B)
    st = dec.stats()
    dcd["graphed_replay" if graphed else "eager_static"] = per(st["times_s"], st["counts"], mode)
    if graphed:
        dec.reset_stats()
        dec.sample_rows(rs2, z, 16, 1.0, toks, torch.Generator().manual_seed(5), limits=[16] * B)
        st = dec.stats()
        dcd["graphed_replay_cpu_generator"] = per(st["times_s"], st["counts"], "replay")
        # wall per token of a 16-token call with a CPU generator (4 MB of log-probs to the host per token); includes
        # the call's load_rows and its eager <think> ⊕ z ⊕ </think> chunk, amortized over 16 tokens
        _, wall = timed(dev, lambda: dec.sample_rows(rs2, z, 16, 1.0, toks, torch.Generator().manual_seed(5),
                                                      limits=[16] * B))
        dcd["wall_ms_per_token_cpu_generator"] = round(1e3 * wall / 16, 2)
        _, wall = timed(dev, lambda: dec.sample_rows(rs2, z, 16, 1.0, toks, torch.Generator(device=dev).manual_seed(5),
                                                      limits=[16] * B))
        dcd["wall_ms_per_token_cuda_generator"] = round(1e3 * wall / 16, 2)
        eager_dec = CG.GraphedDecoder(sampler, capacity=capacity, graphed=False, profile=True, attention=a.attention)
        eager_dec.frozen = dec.frozen
        eager_dec.sample_rows(rs2, z, a.eager_steps + 1, 1.0, toks, gen_smp, limits=[a.eager_steps + 1] * B)
        st = eager_dec.stats()
        dcd["eager_static"] = per(st["times_s"], st["counts"], "eager")
        del eager_dec
    res["decode_ms_per_token"] = dcd

    def retime() -> dict:
        """The graphed latent step and decoded token again, graphs captured anew on the rows timed above (eager on
        the CPU): for a comparison under another kernel choice in the same process."""
        loop2 = CG.GraphedLatentLoop(thinker, capacity=capacity, graphed=graphed, profile=True, attention=a.attention)
        loop2.frozen = loop.frozen
        loop2.run_rows(rs, K, sigma, scale, toks, gen_lat)  # warm-up + capture + replays
        loop2.reset_stats()
        loop2.run_rows(rs, K, sigma, scale, toks, gen_lat)
        st = loop2.stats()
        out = {"latent_graphed_replay_ms": per(st["times_s"], st["counts"], mode)}
        dec2 = CG.GraphedDecoder(sampler, capacity=capacity, graphed=graphed, profile=True, attention=a.attention)
        dec2.frozen = dec.frozen
        dec2.sample_rows(rs2, z, A, 1.0, toks, gen_smp, limits=[A] * B)
        dec2.reset_stats()
        dec2.sample_rows(rs2, z, A, 1.0, toks, gen_smp, limits=[A] * B)
        st = dec2.stats()
        out["decode_graphed_replay_ms"] = per(st["times_s"], st["counts"], mode)
        del loop2, dec2
        return out

    mine = (lat["graphed_replay" if graphed else "eager_static"], dcd["graphed_replay" if graphed else "eager_static"])
    if a.compare_layout:  # the same rows, graphs captured again under another NF4 layout
        from engine import nf4_kernels as NK

        kept = dict(NK.CONFIG)
        applied = apply_layouts(a.compare_layout).get("nf4", {})
        cmp_ = {"layout": applied, "qualification_passed": NK.qualify(dev)["passed"], **retime()}
        NK.CONFIG.clear()
        NK.CONFIG.update(kept)
        res["compare_layout"] = cmp_
        print(f"under {a.compare_layout}: latent {cmp_['latent_graphed_replay_ms']} ms/step, decode "
              f"{cmp_['decode_graphed_replay_ms']} ms/token (this run's layout: {mine[0]} / {mine[1]})", flush=True)
    if a.compare_gdn_step:  # the same rows, graphs captured again with the other one-token GDN step
        from engine import gdn_step as GS

        kept = set(GS._STATE["devices"])
        other = "torch" if kept else "fused"
        if kept:
            GS._STATE["devices"].clear()
        elif GS.install("auto", base.config, dev) != "fused":
            other = None
        if other:
            res["compare_gdn_step"] = cmp_ = {"gdn_step": other, **retime()}
            print(f"with the GDN step {other}: latent {cmp_['latent_graphed_replay_ms']} ms/step, decode "
                  f"{cmp_['decode_graphed_replay_ms']} ms/token (this run's: {mine[0]} / {mine[1]})", flush=True)
        GS._STATE["devices"].clear()
        GS._STATE["devices"].update(kept)

    # -- prefix cache: computed share, cached vs uncached logits -------------------------------------------------
    tin = sum(r["latent_input_tokens"] for r in turns)
    tcomp = sum(r["latent_computed_tokens"] for r in turns)
    res["prefix_cache"] = {"latent_input_tokens": tin, "latent_computed_tokens": tcomp,
                           "latent_computed_share": round(tcomp / max(1, tin), 4),
                           "counters": tcache.counters(),
                           "sampler_counters": None if scache is tcache else scache.counters()}
    _, head, _ = M._parts(thinker)

    def logits_of(h):
        return head(h.to(dev)[None]).float()[0]

    def gap(x, y):
        return {"max_abs_logit_diff": float((x - y).abs().max()),
                "max_abs_logprob_diff": float((torch.log_softmax(x, -1) - torch.log_softmax(y, -1)).abs().max())}

    lc = {}
    with torch.no_grad(), loop.frozen:
        last = history[-1][0]  # row 0's last-turn prefix (stored in the cache at a turn boundary)
        n, st_ = tcache.lookup(last)
        assert n == len(last), (n, len(last))
        cached = logits_of(st_.last_hidden)
        full = text(input_ids=torch.tensor([last], device=dev),
                    position_ids=torch.arange(len(last), device=dev)[None]).last_hidden_state[0, -1]
        uncached = logits_of(full)
        lc["final_prefix"] = {"tokens": len(last), **gap(cached, uncached), "logit_scale": float(uncached.abs().max())}
        rec = PC.prefill_rows(thinker, [last], None, [bounds[0][:-1]])  # recomputed, same turn boundaries, no cache
        lc["final_vs_recomputed_same_chunks"] = gap(cached, logits_of(rec.rows[0].last_hidden))
        n0, st0 = tcache.lookup(c0)
        full0 = text(input_ids=torch.tensor([c0], device=dev),
                     position_ids=torch.arange(len(c0), device=dev)[None]).last_hidden_state[0, -1]
        lc["c0_one_chunk"] = {"tokens": len(c0), **gap(logits_of(st0.last_hidden), logits_of(full0))}
        if sampler is not thinker:  # NF4 trainer vs BF16 sampler on the same prefix: what the parity gate sees
            n1, st1 = scache.lookup(last)
            with dec.frozen:
                ls = M._parts(sampler)[1](st1.last_hidden.to(dev)[None]).float()[0]
            lc["trainer_vs_sampler"] = {**gap(cached, ls), "argmax_equal": bool(cached.argmax() == ls.argmax())}
    lc["max_abs_logit_diff"] = lc["final_prefix"]["max_abs_logit_diff"]
    lc["max_abs_logprob_diff"] = lc["final_prefix"]["max_abs_logprob_diff"]
    res["logits_check"] = lc

    if a.profile:  # on the CPU (--small) only the decode profile's flow runs (no CUDA kernels to list)
        res["profile"] = (profile_section(a, thinker, prefixes, history, tcache, capacity, K, sigma, scale, toks, dev)
                          if graphed else {})
        res["profile"]["decode"] = profile_decode(a, sampler, prefixes, history, scache, capacity, K, toks, dev)
        if graphed and a.base == "nf4" and thinker is not trainer:
            scache.clear()
            res["profile"]["trainer_latent"] = profile_trainer_latent(a, trainer, prefixes, history, capacity, K,
                                                                      sigma, scale, toks, dev)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    if graphed:
        res["gpu_peak_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
    res["targets"] = {
        "latent_step_ms<=15": lat["graphed_replay"] is not None and lat["graphed_replay"] <= 15,
        "decode_ms_per_token<=13": dcd["graphed_replay"] is not None and dcd["graphed_replay"] <= 13,
        "computed_share<=0.10": res["prefix_cache"]["latent_computed_share"] <= 0.10,
        "logits_within_1e-3": res["logits_check"]["max_abs_logprob_diff"] <= 1e-3,
        "generation_per_turn<=1.5s": res["generation_s_per_turn"]["later_mean"] <= 1.5,
    }
    print_table(res)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


def profile_section(a, trainer, prefixes, history, tcache, capacity, K, sigma, scale, toks, dev) -> dict:
    """Latent replay ms/step with each attention route, and a kernel profile of eager static steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import cuda_graphs as CG
    from engine import prefix_cache as PC

    B = len(prefixes)
    bounds = [[len(h[i]) for h in history] for i in range(B)]
    with CG.FrozenAdapter(trainer):
        rs = PC.prefill_rows(trainer, prefixes, tcache, bounds)
    out = {"latent_replay_ms_by_attention": {}}
    g = torch.Generator(device=dev).manual_seed(9)
    from engine import attention_kernels as AT

    # gqa: the decode attention kernels where they qualified; gqa-torch: the same route on the FP32 PyTorch path
    for attn in ("hf", "gqa", "gqa-torch"):
        out["latent_replay_ms_by_attention"][attn] = latent_replay_ms(
            trainer, rs, capacity, K, sigma, scale, toks, g, attn.split("-")[0],
            without=AT._STATE["devices"] if attn == "gqa-torch" else None)
    out.update(eager_step_profile(a, trainer, rs, capacity, sigma, scale, toks, g, dev))
    return out


def latent_replay_ms(model, rs, capacity, K, sigma, scale, toks, g, attention, without: set | None = None) -> float:
    """ms per graphed latent step (replay only, after a warm-up + capture call) on prefilled rows `rs`; `without`:
    a kernel family's set of qualified devices, emptied while this loop is built and captured (its fallback runs)."""
    from engine import cuda_graphs as CG

    saved = set(without) if without is not None else set()
    if without is not None:
        without.clear()
    try:
        lp = CG.GraphedLatentLoop(model, capacity=capacity, graphed=True, profile=True, attention=attention)
        lp.run_rows(rs, K, sigma, scale, toks, g)  # warm-up + capture
        lp.reset_stats()
        lp.run_rows(rs, K, sigma, scale, toks, g)  # replay only
    finally:
        if without is not None:
            without.update(saved)
    t, c = lp.stats()["times_s"], lp.stats()["counts"]
    return round(1e3 * t["replay"] / c["replay"], 2)


def eager_step_profile(a, model, rs, capacity, sigma, scale, toks, g, dev) -> dict:
    """kernel_profile of an eager static latent step on `model` (after two eager steps on `rs`)."""
    import torch

    from engine import cuda_graphs as CG

    ev = CG.GraphedLatentLoop(model, capacity=capacity, graphed=False, attention=a.attention)
    ev.run_rows(rs, 2, sigma, scale, toks, g)
    with ev._adapter(), torch.no_grad():
        return kernel_profile(ev._step, dev)


def profile_trainer_latent(a, trainer, prefixes, history, capacity, K, sigma, scale, toks, dev) -> dict:
    """The latent step on the NF4 trainer itself (latent.engine: trainer), graphed, with the NF4 small-batch kernel
    (engine/nf4_kernels.py) and with bitsandbytes' forward, side by side; and a kernel profile of its eager step
    with the kernel. Where the NF4 kernel did not qualify both rows are bitsandbytes'."""
    import torch

    from engine import cuda_graphs as CG
    from engine import nf4_kernels as NK
    from engine import prefix_cache as PC

    B = len(prefixes)
    bounds = [[len(h[i]) for h in history] for i in range(B)]
    cache = PC.PrefixCache(8 << 30)
    with CG.FrozenAdapter(trainer):
        rs = PC.prefill_rows(trainer, prefixes, cache, bounds)
    out = {"nf4_kernel_installed": bool(NK._STATE["devices"]), "latent_replay_ms": {}}
    g = torch.Generator(device=dev).manual_seed(11)
    for mode in ("nf4_kernel", "bitsandbytes"):
        out["latent_replay_ms"][mode] = latent_replay_ms(
            trainer, rs, capacity, K, sigma, scale, toks, g, a.attention,
            without=NK._STATE["devices"] if mode == "bitsandbytes" else None)
    out.update(eager_step_profile(a, trainer, rs, capacity, sigma, scale, toks, g, dev))
    out["floor_ms"] = round(weight_bytes(trainer) / HBM_BYTES_PER_S * 1e3, 2)
    del rs, cache
    return out


def profile_decode(a, sampler, prefixes, history, scache, capacity, K, toks, dev) -> dict:
    """A kernel profile of eager static decode steps of the sampler (the answers' per-token step), with the graphed
    replay's ms/token beside it: the gap between the two is what the graph does not remove."""
    import torch

    from engine import cuda_graphs as CG
    from engine import prefix_cache as PC

    B = len(prefixes)
    bounds = [[len(h[i]) for h in history] for i in range(B)]
    d = sampler.get_input_embeddings().weight.shape[1]
    z = torch.randn(B, K, d, generator=torch.Generator().manual_seed(3)).to(dev) * 0.02
    out = {}
    for graphed in ((True, False) if dev.type == "cuda" else (False,)):
        dec = CG.GraphedDecoder(sampler, capacity=capacity, graphed=graphed, profile=True, attention=a.attention)
        with dec._adapter(), torch.no_grad():
            rs = PC.prefill_rows(sampler, prefixes, scache, bounds)
            key = dec._start_rows(rs, z, 32, 1.0, toks)
            if graphed:
                for _ in range(3):  # warm-up, capture, one replay
                    dec._run_step(key)
                dec.reset_stats()
                for _ in range(8):
                    dec._run_step(key)
                st = dec.stats()
                out["graphed_replay_ms"] = round(1e3 * st["times_s"]["replay"] / st["counts"]["replay"], 2)
            else:
                out.update(kernel_profile(dec._step, dev))
        del dec
    return out


GEMM_NAMES = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90", "splitk", "dequantize", "kgemm")


def kernel_profile(step, dev, steps: int = 3) -> dict:
    """Kernels of `steps` eager calls of step() (one warm-up call first): count, ms of kernel time per step, the
    top 40 by time, and totals by kind (matrix products and NF4 dequantization / everything else)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync(dev)
    eager_ms = (time.perf_counter() - t) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync(dev)
    kern = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kern)
    calls = sum(e.count for e in kern)
    top = sorted(kern, key=lambda e: -e.self_device_time_total)[:40]
    gemm = [e for e in kern if any(n in e.key.lower() for n in GEMM_NAMES)]
    return {"eager_ms_per_step": round(eager_ms, 2), "kernels_per_step": round(calls / steps),
            "kernel_ms_per_step": round(total / 1e3 / steps, 2),
            "by_kind_ms_per_step": {"matmul_and_dequant": round(sum(e.self_device_time_total for e in gemm) / 1e3 / steps, 2),
                                    "other": round(sum(e.self_device_time_total for e in kern if e not in gemm) / 1e3 / steps, 2)},
            "by_kind_calls_per_step": {"matmul_and_dequant": round(sum(e.count for e in gemm) / steps),
                                       "other": round(sum(e.count for e in kern if e not in gemm) / steps)},
            "top_kernels": [{"name": e.key, "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 3),
                             "calls_per_step": e.count / steps} for e in top]}


def print_table(res: dict) -> None:
    a = res["args"]
    print(f"\n== recipe {a['base']}: {res['params'] / 1e9:.2f} B params, rows {a['rows']}, prompt {a['prompt_tokens']}, "
          f"K {a['thoughts']}, answer {a['answer_tokens']}, tool {a['tool_tokens']}, turns {a['turns']} "
          f"({res['device']}, torch {res['torch']}, transformers {res['transformers']})")
    print(f"{'turn':>4} {'prefill s':>10} {'latent s':>9} {'answers s':>10} {'gym s':>7} {'gen s':>7} {'computed/input':>16}")
    for r in res["turns"]:
        print(f"{r['turn']:>4} {r['prefill_s']:>10.3f} {r['latent_s']:>9.3f} {r['answers_s']:>10.3f} {r['gym_s']:>7.4f} "
              f"{r['generation_s']:>7.3f} {r['latent_computed_tokens']:>7}/{r['latent_input_tokens']:<8}")
    ph = res["phases_s"]
    print(f"{'sum':>4} {ph['prefill_s']:>10.3f} {ph['latent_s']:>9.3f} {ph['answers_s']:>10.3f} {ph['gym_s']:>7.4f}")
    lat, dcd, fl = res["latent_ms_per_step"], res["decode_ms_per_token"], res["floor_ms"]
    print(f"latent ms/step (batch {a['rows']}): graphed {lat['graphed_replay']}  eager static {lat['eager_static']}  "
          f"eager HF dynamic {lat['eager_hf_dynamic']}  | floor {fl['latent']} ms (target <= 15)")
    print(f"decode ms/token (batch {a['rows']}): graphed {dcd['graphed_replay']}  eager static {dcd['eager_static']}  "
          f"| 16-token call wall/token (incl. chunk) CUDA gen {dcd.get('wall_ms_per_token_cuda_generator')}  CPU gen "
          f"{dcd.get('wall_ms_per_token_cpu_generator')}  | floor {fl['sampler']} ms (target <= 13)")
    pc, lc = res["prefix_cache"], res["logits_check"]
    print(f"prefix cache: latent model computed {pc['latent_computed_tokens']}/{pc['latent_input_tokens']} = "
          f"{pc['latent_computed_share']:.1%} (target <= 10 %); cached vs uncached one-shot: max |dlogit| "
          f"{lc['max_abs_logit_diff']:.2e}, max |dlogp| {lc['max_abs_logprob_diff']:.2e} (target <= 1e-3)")
    print(f"  cached vs recomputed with the same turn chunks: {lc['final_vs_recomputed_same_chunks']}; c_0 cached vs "
          f"one-shot (one chunk both): {lc['c0_one_chunk']}")
    if "trainer_vs_sampler" in lc:
        print(f"  NF4 trainer vs BF16 sampler, same prefix: {lc['trainer_vs_sampler']}")
    if "profile" in res:
        pr = res["profile"]
        if "top_kernels" in pr:
            print(f"profile: latent replay ms/step by attention {pr['latent_replay_ms_by_attention']}; eager static "
                  f"step: {pr['eager_ms_per_step']} ms wall, {pr['kernels_per_step']} kernels, {pr['kernel_ms_per_step']} "
                  f"ms of kernels, by kind {pr['by_kind_ms_per_step']} ms, {pr['by_kind_calls_per_step']} calls")
        for k in pr.get("top_kernels", [])[:15]:
            print(f"  {k['ms_per_step']:>8.3f} ms {k['calls_per_step']:>6.0f}x  {k['name'][:100]}")
        if "decode" in pr:
            dp = pr["decode"]
            print(f"profile: decode graphed replay {dp.get('graphed_replay_ms')} ms/token; eager static step "
                  f"{dp['eager_ms_per_step']} ms wall, {dp['kernels_per_step']} kernels, {dp['kernel_ms_per_step']} ms "
                  f"of kernels, by kind {dp['by_kind_ms_per_step']} ms, {dp['by_kind_calls_per_step']} calls")
            for k in dp["top_kernels"][:20]:
                print(f"  {k['ms_per_step']:>8.3f} ms {k['calls_per_step']:>6.0f}x  {k['name'][:100]}")
    gs = res["generation_s_per_turn"]
    print(f"generation per model turn: first {gs['first']} s, later mean {gs['later_mean']} s (target <= 1.5 s)")
    if "export_equal" in res:
        print(f"NF4: {res['quantized_layers']} layers quantized in {res['quantize_s']:.1f} s; BF16 export equal to the "
              f"trainer's dequantized weights: {res['export_equal']}")
    print("kernels:", res["kernels"], "| latent loop on the", res["latent_engine"])
    print("targets:", ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in res["targets"].items()))


if __name__ == "__main__":
    main()
