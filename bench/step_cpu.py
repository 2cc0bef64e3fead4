"""Per-phase seconds of one fresh and one reuse GRPO step of the embedded default on the CPU, through Prefect,
and Prefect's overhead as a share of step time.

    python bench/step_cpu.py [--from-run runs/tiny] [--bootstrap-episodes N] [--json out.json]

`--from-run` copies the tokenizer and bootstrap base of an earlier run of the default config (saves the ~4 min
bootstrap); without it the bench bootstraps itself (`--bootstrap-episodes` shrinks that, but a less trained base
writes different answers, so its step times are not the default's).

Steps 0 (fresh) and 1 (reuse) warm the engines up (model loads, first-call costs); steps 2 (fresh) and 3 (reuse)
are measured. Stage seconds are measured inside the stages; the step's wall time is measured around the flow
call; the difference is what Prefect (task orchestration, result persistence, artifacts) costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def prepare(run_dir: Path, episodes: int | None, from_run: str | None) -> str:
    from configs.schema import load_config
    from flows.train import init_run_dir
    from stages.prepare import prepare_run

    import shutil

    overrides = {"run_dir": str(run_dir), "steps.pattern": ["fresh", "reuse"]}
    if episodes is not None:
        overrides["bootstrap.episodes"] = episodes
    cfg = load_config("tiny", overrides)
    rd = init_run_dir(cfg)
    for sub in ("tokenizer", "bootstrap") if from_run else ():
        shutil.copytree(Path(from_run) / sub, rd.root / sub, dirs_exist_ok=True)
    prepare_run(str(rd.root))
    return str(rd.root)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap-episodes", type=int, default=None)
    ap.add_argument("--from-run", default=None, help="reuse tokenizer + bootstrap of a run of the default config")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="lgrpo-bench-"))
    t = time.perf_counter()
    rd = prepare(run_dir, args.bootstrap_episodes, args.from_run)
    print(f"prepared {rd} in {time.perf_counter() - t:.1f}s")
    from flows.step import grpo_step

    rows = []
    for step in range(4):
        t0 = time.perf_counter()
        m = grpo_step(rd, step)
        wall = time.perf_counter() - t0
        stage = sum(m["phases"].values())
        rows.append({"step": step, "kind": m["kind"], "wall_s": round(wall, 3), "stage_s": round(stage, 3),
                     "prefect_s": round(wall - stage, 3), "prefect_share": round((wall - stage) / wall, 4),
                     "phases": m["phases"], "answer_tokens": m.get("answer_tokens")})
    measured = rows[2:]
    phases = sorted({k for r in measured for k in r["phases"]}, key=lambda k: list(measured[0]["phases"]).index(k)
                    if k in measured[0]["phases"] else 99)
    print(f"\n{'phase':18s} {'fresh (s)':>10s} {'reuse (s)':>10s}")
    for ph in phases:
        f = measured[0]["phases"].get(ph)
        r = measured[1]["phases"].get(ph)
        print(f"{ph:18s} {f if f is not None else '-':>10} {r if r is not None else '-':>10}")
    for r in measured:
        print(f"{r['kind']:5s} step {r['step']}: wall {r['wall_s']:.3f}s, stages {r['stage_s']:.3f}s, "
              f"Prefect overhead {r['prefect_s']:.3f}s = {100 * r['prefect_share']:.1f}% of the step")
    print(f"reuse/fresh wall ratio: {measured[1]['wall_s'] / measured[0]['wall_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": rows}, indent=2))


if __name__ == "__main__":
    main()
