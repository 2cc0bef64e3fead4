"""Rollout parity of both samplers on the same tokens, side by side.

    python bench/parity_samplers.py --from-run runs/tiny-vllm [--steps 0 2 4] [--out parity.json]

For stored fresh steps of a run: the trainer's replay log-probs (replay.arrow) against (a) the log-probs the run's
sampler recorded while sampling (rollouts.arrow: vLLM for a `sampler.kind: vllm` run) and (b) the HF sampler
scoring the same answer tokens through its own incremental decode path (the export checkpoint and the step's adapter,
model.dtype). Gate numbers as the rollout parity gate computes them (tokens either engine gives >= 1 %).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-run", required=True)
    ap.add_argument("--steps", type=int, nargs="*", default=None, help="fresh steps (default: all stored)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from artifacts import RunDir, read_json, read_table, to_tensor_list
    from engine import diagnose as D
    from engine import gates
    from engine import runtime
    from stages.context import run_config
    from stages.export import export_base
    from flows.step import step_inputs

    rd = RunDir(Path(args.from_run))
    cfg = run_config(rd.root)
    base = read_json(rd.prepared())["base"]
    export = export_base(str(rd.root), base)["path"]
    steps = args.steps if args.steps is not None else [s for s in rd.steps() if cfg.steps.kind_of(s) == "fresh"
                                                        and rd.replay(s).exists()]
    hf_cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"kind": "hf"})})
    hf = runtime.sampler(hf_cfg, export, base)
    lim = dict(mean_max=cfg.gates.parity_mean_max, token_max=cfg.gates.parity_token_max,
               min_prob=cfg.gates.parity_min_prob)
    rows, totals = [], {"recorded": ([], []), "hf": ([], [])}
    rec = f"recorded ({cfg.sampler.kind})"
    for step in steps:
        roll, rep = read_table(rd.rollouts(step)), read_table(rd.replay(step))
        hf.use_adapter(step_inputs(str(rd.root), step)["adapter"])
        trainer = [list(x) for x in rep.column("trainer_logps").to_pylist()]
        recorded = roll.column("sampler_logps").to_pylist()
        thoughts = to_tensor_list(roll, "thoughts", torch.float32)
        answers, prefixes = roll.column("answer_ids").to_pylist(), roll.column("prefix_ids").to_pylist()
        hf_lp = []
        for p, z, a in zip(prefixes, thoughts, answers):
            lsm = D.cached_decode(hf.model, p, z, a, cfg.sampler.temperature, hf.toks)
            hf_lp.append([float(lsm[j, t]) for j, t in enumerate(a)])
        r_rec, _ = gates.rollout_parity(trainer, recorded, **lim)
        r_hf, _ = gates.rollout_parity(trainer, hf_lp, **lim)
        rows.append({"step": step, rec: {k: r_rec[k] for k in ("tokens_considered", "mean_gap", "max_gap")},
                     "hf": {k: r_hf[k] for k in ("tokens_considered", "mean_gap", "max_gap")}})
        for name, r in (("recorded", r_rec), ("hf", r_hf)):
            totals[name][0].append(r["mean_gap"] * r["tokens_considered"])
            totals[name][1].append(r["tokens_considered"])
        print(f"step {step:3d}: {rec} {r_rec['tokens_considered']:5d} tokens mean {r_rec['mean_gap']:.3g} "
              f"max {r_rec['max_gap']:.3g} | hf replayed {r_hf['tokens_considered']:5d} tokens mean {r_hf['mean_gap']:.3g} "
              f"max {r_hf['max_gap']:.3g}")
    summary: dict = {}
    for name, (weighted, counts) in totals.items():
        n = sum(counts)
        label = rec if name == "recorded" else "hf"
        summary[label] = {"tokens_considered": n, "mean_gap": sum(weighted) / max(n, 1),
                          "max_gap": max((r[label]["max_gap"] for r in rows), default=0.0)}
        print(f"all steps, {label}: {n} tokens considered, mean gap {summary[label]['mean_gap']:.4g}, max gap "
              f"{summary[label]['max_gap']:.4g} (gate: mean <= {lim['mean_max']}, max <= {lim['token_max']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"run": str(rd.root), "steps": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
