"""The thought log-density gap between generation and replay on one GPU (BF16): model.attention_fp32 on and off,
against the GDN kernels (fla where qualified, or the PyTorch reference) and the CUDA-graphed latent loop.

    python bench/thought_gap.py --out F.json

Each variant makes a fresh run of the embedded default (shrunk like tests/test_gpu_pipeline.py: 4 groups x 4 rows,
3 turns, device cuda, BF16) and takes one fresh step through the stages. The figure per variant is the largest
|recorded - replayed| log q(z) over every thought of the step (what gates.thought_logq_gap_max limits when
model.attention_fp32 is on), with its distribution over thoughts. The gate itself is lifted to 1e9 here so that every
variant is measured to the end; the bench reports, it does not judge (the gate's limit stays where configs/ put it).
attention_fp32 with fla's GDN kernels (38.3 nat on the H200, bench/results/h200-thought-gap-2026-12-01.json) is
refused by the config since, so it is no longer a variant here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "attn-bf16 gdn-auto": {},
    "attn-bf16 gdn-torch": {"model.gdn_kernels": "torch"},
    "attn-fp32 gdn-torch": {"model.attention_fp32": True, "model.gdn_kernels": "torch"},
    "attn-fp32 gdn-torch eager": {"model.attention_fp32": True, "model.gdn_kernels": "torch", "generation.cuda_graphs": False},
}


def gaps(step: dict) -> list[float]:
    from artifacts import read_table

    gen = read_table(step["rollouts"]).column("thought_logq").to_pylist()
    rep = read_table(step["replay"]["path"]).column("trainer_logq").to_pylist()
    return [abs(a - b) for x, y in zip(gen, rep) for a, b in zip(x, y)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the bench itself (no CUDA graphs, no fla)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import numpy as np
    import torch

    from artifacts import read_json
    from engine import gdn, runtime
    from tests.conftest import fresh_step, make_run

    res: dict = {"args": vars(a), "versions": gdn.versions(), "variants": {}}
    for name in a.variants:
        runtime.clear()
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = make_run(Path(tmp) / "run", **{
                "device": a.device, "model.dtype": "bfloat16", "threads": None, "gym.max_turns": 3,
                "grpo.num_generations": 4, "grpo.groups_per_step": 4, "bootstrap.episodes": 128,
                "bootstrap.epochs": 2, "sampler.max_answer_tokens": 48,
                "gym.reward_funcs": ["examples.rewards:valid_tool_calls"],
                "gates.thought_logq_gap_max": 1e9, **VARIANTS[name]})
            prep = read_json(f"{run_dir}/prepared.json")
            s0 = fresh_step(run_dir, 0, prep["adapter_init"])
            g = np.array(gaps(s0))
        row = {"overrides": VARIANTS[name], "thoughts": int(g.size), "gap_max": float(g.max()),
               "gap_p50": float(np.median(g)), "gap_p99": float(np.quantile(g, 0.99)),
               "share_zero": float((g == 0).mean()), "optimize_gap_max": s0["optimize"]["thought_logq_gap_max"],
               "parity_max": s0["optimize"].get("parity_max"), "wall_s": round(time.perf_counter() - t, 1)}
        res["variants"][name] = row
        print(name, json.dumps(row), flush=True)
        runtime.clear()
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
