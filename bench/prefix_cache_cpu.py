"""Prefix cache on the CPU: input vs computed tokens and cached vs uncached prefill seconds, one GRPO group.

    python bench/prefix_cache_cpu.py [--scenario tiny|long|both] [--rows 4] [--repeats 3] [--threads 1]

A group of `rows` rollouts shares its first prompt c_0; every turn adds each row's answer and observation tokens
(c_{t+1} = c_t ⊕ answer ⊕ observation, random ids). Scenarios (prompt / answer / observation tokens, turns):
    tiny  17 / 19 / 12, 4 turns  (the embedded default's measured lengths: runs/tiny step 2)
    long  384 / 32 / 48, 8 turns (an agent prompt with tool descriptions)
Per turn: prefix tokens asked for (input) vs run through the model (computed), and median wall seconds of
    prefill   uncached: one left-padded batch forward of all prefixes (what engine.latent.latent_loop does)
              cached:   prefill_rows (each row alone from its longest stored prefix) + stack_rows
    latent    the whole latent loop (K thoughts): engine.latent.latent_loop vs latent_loop_cached
Each timed cached repeat starts from a copy of the cache as it was before the turn. Tiny random model (configs/tiny
arch, 512-token vocab), fp32, CPU: compare ratios, not absolute seconds. "+ sampler" counts the sampler's prefill of
the same prefixes as hits on the same cache (only valid when trainer and sampler hold the same weights).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SCENARIOS = {"tiny": (17, 19, 12, 4), "long": (384, 32, 48, 8)}


def episodes(rows, prompt, answer, obs, turns, vocab, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()  # noqa: E731
    c0 = rnd(prompt)
    out = [[list(c0) for _ in range(rows)]]
    for _ in range(turns - 1):
        out.append([p + rnd(answer) + rnd(obs) for p in out[-1]])
    return out


def median_s(fn, repeats, setup=lambda: None):
    ts = []
    for _ in range(repeats):
        arg = setup()
        t = time.perf_counter()
        fn() if arg is None else fn(arg)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def run(name, model, toks, rows, repeats, K):
    import torch

    from engine import model as M
    from engine import latent as LT
    from engine import prefix_cache as PC

    prompt, answer, obs, turns = SCENARIOS[name]
    eps = episodes(rows, prompt, answer, obs, turns, model.config.vocab_size)
    text, _, emb = M._parts(model)
    scale = M.embed_scale(model)
    sigma = 0.05 * scale
    pc = PC.PrefixCache(1 << 30)
    print(f"\n== {name}: {rows} rows x {turns} turns, prompt {prompt}, answer {answer}, observation {obs} tokens, K={K}")
    print(f"{'turn':>4} {'input':>6} {'computed':>8} {'share':>6} | {'prefill s: uncached':>19} {'cached':>7} {'x':>5} | "
          f"{'latent s: uncached':>18} {'cached':>7} {'x':>5}")
    tot = {"in": 0, "comp": 0, "pu": 0.0, "pc": 0.0, "lu": 0.0, "lc": 0.0}
    for t, prefixes in enumerate(eps):
        def uncached_prefill():
            from transformers import DynamicCache

            x, mask, pos = M.left_pad([emb(torch.tensor(p)) for p in prefixes])
            with torch.no_grad():
                text(inputs_embeds=x, attention_mask=mask, position_ids=pos, **M.cache_kw(DynamicCache(config=text.config)),
                     use_cache=True)

        def cached_prefill(c):
            PC.stack_rows(PC.prefill_rows(model, prefixes, c))

        def latent(c):
            PC.latent_loop_cached(model, prefixes, K, sigma, scale, toks, torch.Generator().manual_seed(t), c)

        pu = median_s(uncached_prefill, repeats)
        pcs = median_s(cached_prefill, repeats, lambda: copy.deepcopy(pc))
        lu = median_s(lambda: LT.latent_loop(model, prefixes, K, sigma, scale, toks, torch.Generator().manual_seed(t)),
                      repeats)
        lc = median_s(latent, repeats, lambda: copy.deepcopy(pc))
        pc.reset_counters()
        latent(pc)  # advance the real cache by this turn (counted)
        share = pc.computed_tokens / pc.input_tokens
        print(f"{t:>4} {pc.input_tokens:>6} {pc.computed_tokens:>8} {share:>6.1%} | {pu:>19.4f} {pcs:>7.4f} "
              f"{pu / pcs:>5.1f} | {lu:>18.4f} {lc:>7.4f} {lu / lc:>5.1f}")
        tot["in"] += pc.input_tokens
        tot["comp"] += pc.computed_tokens
        for k, v in (("pu", pu), ("pc", pcs), ("lu", lu), ("lc", lc)):
            tot[k] += v
    print(f"{'all':>4} {tot['in']:>6} {tot['comp']:>8} {tot['comp'] / tot['in']:>6.1%} | {tot['pu']:>19.4f} "
          f"{tot['pc']:>7.4f} {tot['pu'] / tot['pc']:>5.1f} | {tot['lu']:>18.4f} {tot['lc']:>7.4f} "
          f"{tot['lu'] / tot['lc']:>5.1f}")
    print(f"computed share {tot['comp'] / tot['in']:.1%}; + sampler prefill on the same cache "
          f"{tot['comp'] / (2 * tot['in']):.1%}; {len(pc)} entries, {pc.stored_bytes / 2**20:.1f} MiB stored")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=["tiny", "long", "both"], default="both")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from configs.schema import load_config
    from engine import model as M

    torch.set_num_threads(args.threads)
    cfg = load_config("tiny")
    toks = M.Tokens(pad=0, eos=1, think=2, answer_open=3)
    model = M.build_random_model(cfg.model.arch, 512, toks.pad, toks.eos, seed=0).eval()
    print(f"torch {torch.__version__}, {args.threads} thread(s), tiny model fp32 CPU")
    for name in (["tiny", "long"] if args.scenario == "both" else [args.scenario]):
        run(name, model, toks, args.rows, args.repeats, args.K)


if __name__ == "__main__":
    main()
