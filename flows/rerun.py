"""Re-run a stored step from its artifacts: completed stages come back Cached, the failed stage and what follows
run again. With `stage`, that stage and everything after it are forced to re-run.
"""

from __future__ import annotations

from prefect import flow

from flows.step import Stage, grpo_step


@flow(name="lgrpo-rerun-stage", log_prints=True)
def rerun_stage(run_dir: str, step: int, stage: Stage | None = None) -> dict:
    return grpo_step(run_dir, step, force_from=stage)
