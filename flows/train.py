"""A training run: prepare (tokenizer, bootstrap base, initial adapter), one `grpo-step` flow per GRPO step,
and a held-out evaluation before and after training.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import yaml
from prefect import flow
from prefect.artifacts import create_table_artifact

from artifacts import RunDir, atomic_write, write_json
from configs.schema import RunConfig, load_config
from flows import tasks as T
from flows.step import grpo_step
from stages.prepare import record_prepared


def init_run_dir(cfg: RunConfig) -> RunDir:
    """Create (or resume) a run directory. Resuming needs the same config; anything else is refused."""
    rd = RunDir(Path(cfg.run_dir)).ensure()
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=True)
    if rd.config().exists():
        old = RunConfig.model_validate(yaml.safe_load(rd.config().read_text()))
        if old != cfg:
            diff = {k for k, v in cfg.model_dump().items() if old.model_dump().get(k) != v}
            raise ValueError(
                f"{rd.root} holds a run with another config (differs in: {', '.join(sorted(diff))}); "
                "pass a new --run-dir, or the same settings to resume it")
    else:
        atomic_write(rd.config(), lambda tmp: tmp.write_text(text))
    if not (rd.root / "run.json").exists():
        write_json(rd.root / "run.json", {"run_id": uuid.uuid4().hex})
    return rd


@flow(name="lgrpo-train", log_prints=True)
def train(config: str = "tiny", steps: int | None = None, run_dir: str | None = None,
          overrides: dict[str, Any] | None = None) -> dict:
    """Run `steps` GRPO steps of `config` (a preset name or YAML path) into `run_dir`."""
    ov = dict(overrides or {})
    if steps is not None:
        ov["steps.total"] = steps
    if run_dir is not None:
        ov["run_dir"] = run_dir
    cfg = load_config(config, ov)
    rd = init_run_dir(cfg)
    run_dir = str(rd.root)
    tok = T.prepare_tokenizer(run_dir)
    base = T.bootstrap_base(run_dir, tok["path"])
    init = T.init_adapter(run_dir, base["path"])
    record_prepared(run_dir, tok, base, init)
    ex = T.export_base(run_dir, base["path"])
    before = T.evaluate(run_dir, "before", init["path"], ex["path"], base["path"])
    history = []
    for step in range(cfg.steps.total):
        history.append(grpo_step(run_dir, step))
    final = str(rd.adapter(cfg.steps.total - 1))
    verified = T.verify_checkpoint(run_dir, final, base["path"]) if cfg.gates.verify_checkpoint else None
    after = T.evaluate(run_dir, f"step-{cfg.steps.total - 1:04d}", final, ex["path"], base["path"])
    summary = {"run_dir": run_dir, "seed": cfg.seed, "steps": history, "eval_before": before, "eval_after": after,
               "bootstrap": base, "verified_checkpoint": verified}
    write_json(rd.root / "summary.json", summary)
    create_table_artifact(
        key="run-reward",
        table=[{"step": h["step"], "kind": h["kind"], "reward": h.get("reward_mean"), "loss": h["loss"],
                "seconds": h["stage_seconds"]} for h in history],
        description="Reward and loss per step")
    return summary
