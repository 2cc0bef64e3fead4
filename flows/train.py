"""A training run: prepare (tokenizer, bootstrap base, initial adapter), one `grpo-step` flow per GRPO step,
and a held-out evaluation before and after training.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from artifacts import curves, write_json
from configs.schema import load_config
from flows import tasks as T
from flows.step import grpo_step
from stages.prepare import init_run_dir, record_prepared  # noqa: F401  (init_run_dir: public here too)


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
    from engine.runtime import check_device  # lazily: this module stays importable without torch

    check_device(cfg)  # before the bootstrap, not after it
    rd = init_run_dir(cfg)
    run_dir = str(rd.root)
    tok = T.prepare_tokenizer(run_dir)
    base = T.bootstrap_base(run_dir, tok["path"])
    init = T.init_adapter(run_dir, base["path"])
    record_prepared(run_dir, tok, base, init)
    ex = T.export_base(run_dir, base["path"])
    before = T.evaluate(run_dir, "before", init["path"], ex["path"], base["path"])
    curves.write_scalars(run_dir, 0, curves.eval_scalars(before))
    history = []
    for step in range(cfg.steps.total):
        history.append(grpo_step(run_dir, step))
    final = str(rd.adapter(cfg.steps.total - 1))
    verified = T.verify_checkpoint(run_dir, final, base["path"]) if cfg.gates.verify_checkpoint else None
    after = T.evaluate(run_dir, f"step-{cfg.steps.total - 1:04d}", final, ex["path"], base["path"])
    curves.write_scalars(run_dir, cfg.steps.total, curves.eval_scalars(after))
    curves.close(run_dir)
    png = curves.plot_run(run_dir, before, after)
    create_markdown_artifact(key="run-curves", markdown=curves.png_markdown(png, "Reward and parity per step"),
                             description="Fresh-step reward and success, held-out before/after, parity per step")
    summary = {"run_dir": run_dir, "seed": cfg.seed, "steps": history, "eval_before": before, "eval_after": after,
               "bootstrap": base, "verified_checkpoint": verified, **curves.summary_paths(run_dir)}
    write_json(rd.summary(), summary)
    create_table_artifact(
        key="run-reward",
        table=[{"step": h["step"], "kind": h["kind"], "reward": h.get("reward_mean"), "success": h.get("success_rate"),
                "loss": h["loss"], "seconds": h["stage_seconds"]} for h in history],
        description="Reward and loss per step")
    return summary
