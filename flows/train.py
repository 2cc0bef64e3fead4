"""A training run: prepare (tokenizer, bootstrap base, initial adapter), one `grpo-step` flow per GRPO step,
and a held-out evaluation before and after training.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from artifacts import RunDir, checkpoint, curves, read_json, write_json
from configs.params import TrainParameters
from configs.schema import load_config
from engine import pool
from flows import tasks as T
from flows.step import step_flows, unusable_outputs
from stages.prepare import init_run_dir, record_prepared  # noqa: F401  (init_run_dir: public here too)


@flow(name="lgrpo-train", log_prints=True)
def train(params: TrainParameters = TrainParameters()) -> dict:
    """Run a preset's GRPO steps into its run directory; `params` (configs/params.py) names the preset, the commonly
    changed settings and any other override. Prefect validates them (the whole config) before the run starts."""
    cfg = load_config(params.config, params.config_overrides())
    from engine.runtime import check_device  # lazily: this module stays importable without torch

    check_device(cfg)  # before the bootstrap, not after it
    rd = init_run_dir(cfg)
    run_dir = str(rd.root)
    checkpoint.check_run(run_dir)  # resuming: a checkpoint used in place must be as the run recorded it
    tok = T.prepare_tokenizer(run_dir)
    base = T.bootstrap_base(run_dir, tok["path"])
    init = T.init_adapter(run_dir, base["path"])
    record_prepared(run_dir, tok, base, init)
    try:
        return _run_steps(cfg, rd, run_dir, base, init)
    finally:
        pool.close_all()  # the run's worker processes (cfg.workers) end with the run


def _run_steps(cfg, rd, run_dir: str, base: dict, init: dict) -> dict:
    """The export, the held-out evaluation before, the steps, the verified checkpoint and the evaluation after."""
    ex = T.export_base(run_dir, base["path"])
    before = T.evaluate(run_dir, "before", init["path"], ex["path"], base["path"])
    curves.write_scalars(run_dir, 0, curves.eval_scalars(before))
    history = []
    with step_flows() as step_flow:
        for step in range(cfg.steps.total):
            done = finished_step(rd, step)
            history.append(done if done is not None else step_flow(run_dir, step))
        skipped = sum(1 for h in history if h.get("finished_before"))
        if skipped:
            print(f"{skipped} step(s) had finished before this run (their artifacts verify): not run again")
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


def finished_step(rd: RunDir, step: int) -> dict | None:
    """A step that finished in an earlier run of this run directory -- its metrics (written last, after the probe),
    timings, optimizer state and adapter are stored and verify -- as its step flow returned it; else None.

    A resumed run does not run such a step's flow again: replaying it with every stage Cached cost Prefect ~2 s per
    step (7 min at step 209 of the soak drill, growing with every step); `lgrpo rerun --step N` re-runs one."""
    bad = unusable_outputs({"path": str(rd.metrics(step)), "adapter": str(rd.adapter(step)),
                            "optimizer": str(rd.optimizer(step))}) + unusable_outputs({"path": str(rd.timings(step))})
    if bad:
        return None
    return read_json(rd.metrics(step)) | {"phases": read_json(rd.timings(step)), "finished_before": True}
