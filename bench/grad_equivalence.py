"""Gradient equivalence on a saved trajectory, and the BF16-LoRA precision finding (issue: gates & diagnostics).

    python bench/grad_equivalence.py --from-run runs/tiny --step 18 [--out grad_equivalence.json]

Takes a stored fresh step (its rollouts.arrow and replay.arrow, and the adapter it started from) and computes the
adapter gradients of its GRPO loss on several paths, each against the FP32 reference (one full batch, direct
autograd of the loss, every weight and activation FP32):

* pipeline FP32: the production path with the FP32 base (replay graph + driver weights + micro-batched backward);
* pipeline BF16 base + FP32 LoRA masters (the GPU precision policy);
* pipeline BF16 everything (LoRA weights in BF16 too).

Then one AdamW step at lr 1e-5 from the reference gradients with the adapter held in BF16 vs in FP32 masters:
the share of lora_A elements that do not change at all. Gate: relative L2 ≤ 0.002, no tensor outside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-run", required=True, help="a run directory with stored steps (e.g. runs/tiny)")
    ap.add_argument("--step", type=int, default=None, help="a fresh step with a trained input adapter (default: "
                                                           "the last fresh step after step 0)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import torch

    from artifacts import RunDir, read_json
    from stages.context import run_config
    from engine.runtime import build
    from stages.gradcheck import compare, pipeline_gradients, reference_gradients, unchanged_share
    from stages.optimize import loss_inputs

    rd = RunDir(Path(args.from_run))
    cfg = run_config(rd.root)
    fresh = [s for s in rd.steps() if s > 0 and cfg.steps.kind_of(s) == "fresh" and rd.replay(s).exists()]
    step = args.step if args.step is not None else fresh[-1]
    base = read_json(rd.prepared())["base"]
    adapter = str(rd.adapter(step - 1))
    li = loss_inputs(cfg, str(rd.rollouts(step)), str(rd.replay(step)), str(rd.replay(step)))
    print(f"trajectory: {rd.rollouts(step)} ({len(li.rows)} turns of {li.n_rows} rollouts, "
          f"{sum(li.turns.lengths())} tokens); adapter {adapter}")

    t0 = time.perf_counter()
    ref_engine = build(cfg, base, base, adapter_dir=adapter, dtype="float32")
    ref = reference_gradients(cfg, ref_engine, li)
    rows = {"reference_s": round(time.perf_counter() - t0, 2)}
    results = {}
    for name, dtype, lora_bf16 in [("pipeline fp32", "float32", False),
                                   ("pipeline bf16 base + fp32 LoRA masters", "bfloat16", False),
                                   ("pipeline bf16 base + bf16 LoRA", "bfloat16", True)]:
        eng = build(cfg, base, base, adapter_dir=adapter, dtype=dtype)
        if lora_bf16:
            eng.model.to(torch.bfloat16)
        t0 = time.perf_counter()
        results[name] = compare(pipeline_gradients(cfg, eng, li), ref) | {"seconds": round(time.perf_counter() - t0, 2)}
    params = {n: p.detach().clone() for n, p in ref_engine.model.named_parameters() if p.requires_grad}
    precision = {str(d).replace("torch.", ""): unchanged_share(params, ref, args.lr, d)
                 for d in (torch.bfloat16, torch.float32)}

    print(f"\n{'path':44s} {'rel L2':>10s} {'worst tensor':>13s} {'outside':>8s} {'gate':>6s}")
    for name, r in results.items():
        print(f"{name:44s} {r['rel_l2']:10.3e} {r['worst_tensor_rel_l2']:13.3e} "
              f"{r['tensors_outside']:4d}/{r['tensors']:<3d} {'pass' if r['passed'] else 'FAIL':>6s}")
    print(f"\none AdamW step at lr {args.lr:g} from the reference gradients (lora_A elements unchanged):")
    for d, r in precision.items():
        print(f"  adapter in {d:9s}: {r['lora_A_unchanged_share']:.1%} of {r['lora_A_elements']} "
              f"({r['lora_A_with_gradient']} have a non-zero gradient)")
    if args.out:
        Path(args.out).write_text(json.dumps({"step": step, "run": str(rd.root), "gradients": results,
                                              "precision": precision, **rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
