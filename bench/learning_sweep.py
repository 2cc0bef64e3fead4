"""Learning sweep: GRPO runs of a preset over settings x seeds, through the stages (no Prefect), held-out
success and reward before/after, fresh-step reward of the first and last 5 fresh steps.

The numbers equal `lgrpo train`'s for the same settings (the stages are deterministic; Prefect only
orchestrates them), minus the probe and checkpoint gates, at ~1.5 s less per step. Runs share the tokenizer and the
bootstrapped base of `--base-from` (a prepared run directory of the same preset): its cache directories are
copied, so every run here starts from that one base (the bootstrap's own seed is the source run's). One JSON line
per run is appended to `--out`.

    python bench/learning_sweep.py --base-from runs/tiny --name default --seeds 0 1 2
    python bench/learning_sweep.py --base-from runs/tiny --name lr5e-3 --seeds 0 1 2 --set optimizer.lr=5e-3
    python bench/learning_sweep.py --same-base-as runs/tiny --name k0-grpo --seeds 0 1 2 --set latent.max_latent_steps=0
    python bench/learning_sweep.py --table runs/sweep/results.jsonl   # the Markdown table of all runs so far
    python bench/learning_sweep.py --base-from runs/tiny --name long --seeds 0 --eval-every 40 --set steps.total=160
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def copy_prepared(src: Path, dst: Path) -> None:
    """Copy the tokenizer and bootstrap caches of a prepared run (sealed artifacts; readers verify them)."""
    for sub in ("tokenizer", "bootstrap"):
        if (src / sub).exists() and not (dst / sub).exists():
            shutil.copytree(src / sub, dst / sub)


def run_steps(run_dir: str, steps: int, eval_every: int = 0, evaluate_at=None) -> list[dict]:
    """`steps` GRPO steps through the stages, as flows/step.py orders them; one summary per step. With eval_every,
    `evaluate_at(step)` (held-out success and reward of that step's adapter) joins every eval_every-th step's summary
    (not the last: the run's "after" evaluation is that one)."""
    from artifacts import RunDir, read_json
    from stages.context import run_config
    from stages.evaluate import batch_reward_gain
    from stages.export import export_base
    from stages.generate import generate_turn, sample_tasks
    from stages.gym import run_gym
    from stages.rollouts import collect_rollouts
    from stages.optimize import optimize
    from stages.replay import replay

    cfg = run_config(run_dir)
    rd = RunDir(Path(run_dir))
    prep = read_json(rd.prepared())
    base = prep["base"]
    export = export_base(run_dir, base)["path"]
    out, last_fresh = [], None
    for step in range(steps):
        rd.ensure(step)
        kind = cfg.steps.kind_of(step)
        adapter = str(rd.adapter(step - 1)) if step else prep["adapter_init"]
        opt_in = str(rd.optimizer(step - 1)) if step else None
        rec = {"step": step, "kind": kind}
        if kind == "fresh":
            state = sample_tasks(run_dir, step, base)["path"]
            turns, gyms = [], []
            for turn in range(cfg.gym.max_turns):
                tr = generate_turn(run_dir, step, turn, state, adapter, export, base)
                gr = run_gym(run_dir, step, turn, state, tr["path"], base)
                turns.append(tr["path"])
                gyms.append(gr["path"])
                state = gr["path"]
                if gr["all_done"]:
                    break
            ro = collect_rollouts(run_dir, step, turns, gyms)
            rollouts = ro["path"]
            rp = replay(run_dir, step, rollouts, adapter, base, True)
            last_fresh = (rollouts, rp["path"])
            old = rp["path"]
            rec.update(reward=ro["reward_mean"], success=ro["success_rate"], parity_mean=rp.get("parity_mean"))
        else:
            rollouts, old = last_fresh
            rp = replay(run_dir, step, rollouts, adapter, base, False)
            if cfg.steps.kind_of(step - 1) == "fresh":  # the fresh step's update, measured on its own rollouts
                rec["batch_reward_gain"] = batch_reward_gain(rollouts, old, rp["path"])["reward_gain"]
        op = optimize(run_dir, step, rollouts, rp["path"], old, adapter, opt_in, base)
        rec.update(loss=op["loss"], grad_norm=op["grad_norm"])
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            rec["heldout"] = evaluate_at(step)
        out.append(rec)
    return out


def install_same_base(src: Path, rd, cfg) -> None:
    """Use the bootstrapped base of the prepared run `src` as this run's base, whatever this run's settings would
    bootstrap (an ablation of a GRPO-time setting from one base: `--same-base-as`). The base is copied under the name
    this run looks for; its files are verified on load as every artifact is."""
    from artifacts import read_json
    from stages.bootstrap import bootstrap_key

    prep = read_json(src / "prepared.json")
    copy_prepared(src, rd.root)  # the tokenizer (and src's own bootstrap directory, unused under another name)
    tok = rd.root / "tokenizer" / Path(prep["tokenizer"]).name
    target = rd.bootstrap_dir(bootstrap_key(cfg, str(tok)))
    if not target.exists():
        shutil.copytree(src / "bootstrap" / Path(prep["base"]).name, target)  # recorded paths may be relative


def one_run(preset: str, name: str, seed: int, overrides: dict, base_from: Path | None, root: Path,
            eval_every: int = 0, same_base_as: Path | None = None) -> dict:
    from artifacts import read_json
    from configs.schema import load_config
    from stages.evaluate import evaluate
    from stages.export import export_base
    from stages.prepare import init_run_dir, prepare_run

    run_dir = root / f"{name}-s{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg = load_config(preset, {"threads": 1, **overrides, "seed": seed, "run_dir": str(run_dir)})
    rd = init_run_dir(cfg)
    if same_base_as is not None:
        install_same_base(same_base_as, rd, cfg)
    elif base_from is not None:
        copy_prepared(base_from, rd.root)
    t0 = time.time()
    prep = prepare_run(str(rd.root))
    base, init = prep["base"]["path"], prep["adapter_init"]["path"]
    export = export_base(str(rd.root), base)["path"]
    before = evaluate(str(rd.root), "before", init, export, base)
    def evaluate_at(step: int) -> dict:
        ev = evaluate(str(rd.root), f"step-{step:04d}", str(rd.adapter(step)), export, base)
        return {"success": ev["success_rate"], "reward": ev["reward_mean"]}

    steps = run_steps(str(rd.root), cfg.steps.total, eval_every, evaluate_at)
    after = evaluate(str(rd.root), f"step-{cfg.steps.total - 1:04d}", str(rd.adapter(cfg.steps.total - 1)), export,
                     base)
    fresh = [s for s in steps if s["kind"] == "fresh"]
    n = min(5, len(fresh) // 2)
    rec = {
        "name": name, "seed": seed, "preset": preset, "overrides": overrides,
        "heldout_success_before": before["success_rate"], "heldout_success_after": after["success_rate"],
        "heldout_reward_before": before["reward_mean"], "heldout_reward_after": after["reward_mean"],
        "fresh_reward_first": sum(s["reward"] for s in fresh[:n]) / max(n, 1),
        "fresh_reward_last": sum(s["reward"] for s in fresh[-n:]) / max(n, 1),
        "fresh_success_first": sum(s["success"] for s in fresh[:n]) / max(n, 1),
        "fresh_success_last": sum(s["success"] for s in fresh[-n:]) / max(n, 1),
        "batch_reward_gain": (sum(gains) / len(gains)) if (gains := [s["batch_reward_gain"] for s in steps
                                                                     if "batch_reward_gain" in s]) else None,
        "eval_tasks": after["episodes"], "wall_s": round(time.time() - t0, 1), "steps": steps,
        "bootstrap": read_json(rd.prepared())["base"],
    }
    return rec


def table(path: str) -> str:
    """A Markdown table of a results file: one row per setting, seeds side by side, then the seed mean."""
    recs = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r["name"], []).append(r)
    lines = ["| setting | overrides | seeds | held-out success before -> after (per seed) | mean gain | "
             "fresh reward first 5 -> last 5 (per seed) | mean gain | on-batch reward gain per update |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rs in by.items():
        rs = sorted({r["seed"]: r for r in rs}.values(), key=lambda r: r["seed"])  # the latest run per seed
        hs = ", ".join(f"{r['heldout_success_before']:.3f}->{r['heldout_success_after']:.3f}" for r in rs)
        fr = ", ".join(f"{r['fresh_reward_first']:.3f}->{r['fresh_reward_last']:.3f}" for r in rs)
        hg = sum(r["heldout_success_after"] - r["heldout_success_before"] for r in rs) / len(rs)
        fg = sum(r["fresh_reward_last"] - r["fresh_reward_first"] for r in rs) / len(rs)
        ov = " ".join(f"{k}={v}" for k, v in rs[0]["overrides"].items() if k not in ("gym.eval_tasks", "threads"))
        bg = [r["batch_reward_gain"] for r in rs if r.get("batch_reward_gain") is not None]
        bgs = f"{sum(bg) / len(bg):+.3f}" if bg else "-"
        lines.append(f"| {name} | {ov or '-'} | {','.join(str(r['seed']) for r in rs)} | {hs} | {hg:+.3f} | {fr} | "
                     f"{fg:+.3f} | {bgs} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(table(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--name", required=True, help="setting name (run dirs are <root>/<name>-s<seed>)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--base-from", default=None, help="a prepared run dir whose tokenizer/bootstrap caches to reuse")
    ap.add_argument("--same-base-as", default=None,
                    help="a prepared run dir whose bootstrapped base this setting starts from even where its own "
                         "settings would bootstrap another (e.g. thoughts off in GRPO only)")
    ap.add_argument("--root", default="runs/sweep")
    ap.add_argument("--out", default="runs/sweep/results.jsonl")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also evaluate held-out success every N steps (a learning curve in the record's steps)")
    args = ap.parse_args()
    from engine.runtime import set_threads

    overrides = {}
    for it in args.set:
        k, v = it.split("=", 1)
        overrides[k] = yaml.safe_load(v)
    set_threads(int(overrides.get("threads", 1)))
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        rec = one_run(args.config, args.name, seed, overrides, Path(args.base_from) if args.base_from else None, root,
                      args.eval_every, Path(args.same_base_as) if args.same_base_as else None)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{rec['name']} seed {seed}: held-out success {rec['heldout_success_before']:.3f} -> "
              f"{rec['heldout_success_after']:.3f}, reward {rec['heldout_reward_before']:.3f} -> "
              f"{rec['heldout_reward_after']:.3f}; fresh reward first {rec['fresh_reward_first']:.3f} -> last "
              f"{rec['fresh_reward_last']:.3f} ({rec['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
