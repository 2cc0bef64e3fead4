"""Held-out success of a finished run's base and final adapter at several sampling temperatures.

Why (issue 12): the embedded default samples and evaluates at T 1.3, where its bootstrapped base solves ~40-50 % of
held-out tasks; this shows how much of the gap to 100 % is sampling temperature rather than what the base knows,
and whether training moved the policy at the temperatures it was not sampled at.

Each temperature gets a scratch copy of the run directory (links to the run's artifacts, its own sealed config.yaml
with sampler.temperature overridden), then `stages.evaluate.evaluate` of the initial adapter ("before") and
of the last step's adapter, on the same held-out tasks as the run's own evaluation.

    python bench/eval_temperatures.py runs/tiny --temperatures 1.3 1.0 0.7 --out bench/results/cpu-eval-temperatures-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a finished run directory (lgrpo train)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.3, 1.0, 0.7])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from artifacts import RunDir, read_json
    import yaml

    from artifacts.store import atomic_write
    from stages.context import run_config
    from stages.evaluate import evaluate

    src = Path(a.run_dir).resolve()
    cfg = run_config(src)
    last = cfg.steps.total - 1
    final = RunDir(src).adapter(last)
    if not Path(final).exists():
        raise SystemExit(f"{final} missing: {src} has not finished its {cfg.steps.total} steps")
    os.chdir(src.parent.parent)  # prepared.json names its artifacts relative to the project root of the run
    prep = read_json(RunDir(src).prepared())
    scratch = Path(tempfile.mkdtemp(prefix="eval-temperatures-"))
    rows = []
    for T in a.temperatures:
        dst = scratch / f"T{T}"
        dst.mkdir()
        for name in os.listdir(src):
            if not (name.startswith("eval-") or name.startswith("config.yaml")):
                (dst / name).symlink_to(src / name)
        body = yaml.safe_dump(cfg.with_overrides(**{"sampler.temperature": T}).model_dump(mode="json"), sort_keys=True)
        atomic_write(dst / "config.yaml", lambda tmp, body=body: tmp.write_text(body))
        export = str(next((dst / "export").iterdir()))
        row = {"temperature": T}
        for tag, adapter in (("before", prep["adapter_init"]), (f"step-{last:04d}", str(dst / f"step-{last:04d}" / "adapter"))):
            t0 = time.time()
            ev = evaluate(str(dst), tag, adapter, export, prep["base"])
            row["before" if tag == "before" else "after"] = {"success": ev["success_rate"], "reward": ev["reward_mean"],
                                                             "episodes": ev["episodes"], "wall_s": round(time.time() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    shutil.rmtree(scratch)
    res = {"run_dir": str(src), "steps": cfg.steps.total, "trained_temperature": cfg.sampler.temperature, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
