"""Re-run a stored step from its artifacts: completed stages come back Cached, the failed stage and what follows
run again. With `stage`, that stage and everything after it are forced to re-run.
"""

from __future__ import annotations

from uuid import UUID

from prefect import flow, get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from artifacts import checkpoint
from engine import pool
from flows.step import Stage, step_flows


def task_states(flow_run_id: UUID) -> dict[str, str]:
    """Task-run name -> final state name (Completed, Cached, Failed, ...) of one flow run."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: r.state.name for r in sorted(runs, key=lambda r: r.expected_start_time or r.created)}


@flow(name="lgrpo-rerun-stage", log_prints=True)
def rerun_stage(run_dir: str, step: int, stage: Stage | None = None) -> dict:
    checkpoint.check_run(run_dir)  # a checkpoint used in place must be as the run recorded it
    try:
        with step_flows() as step_flow:
            state = step_flow(run_dir, step, force_from=stage, return_state=True)
    finally:
        pool.close_all()  # worker processes (cfg.workers) end with the rerun
    states = task_states(state.state_details.flow_run_id)
    print("task states: " + ", ".join(f"{k}={v}" for k, v in states.items()))
    return state.result() | {"task_states": states}
