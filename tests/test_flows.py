"""Steps through Prefect (prefect_test_harness): task states, caching on re-run, and a gate failure."""

from __future__ import annotations

import pytest

from tests.conftest import make_run

pytestmark = pytest.mark.slow


def _states(state):
    from flows.rerun import task_states

    return task_states(state.state_details.flow_run_id)


def test_two_steps_task_states_and_cached_rerun(prefect_harness, tmp_path):
    from flows.step import grpo_step

    run_dir = make_run(tmp_path / "run", **{"steps.pattern": ["fresh", "reuse"]})
    s0 = grpo_step(run_dir, 0, return_state=True)
    assert s0.is_completed(), s0
    st0 = _states(s0)
    assert st0["export"] == "Completed"
    for name in ("sample-tasks-0", "generate-turn-0-0", "run-gym-0-0", "collect-rollouts-0", "replay-0", "optimize-0"):
        assert st0[name] == "Completed", (name, st0)

    s1 = grpo_step(run_dir, 1, return_state=True)  # reuse step: replays step 0's rollouts
    st1 = _states(s1)
    assert st1 == {"export": "Cached", "replay-1": "Completed", "optimize-1": "Completed"}, st1
    m1 = s1.result()
    assert m1["kind"] == "reuse" and set(m1["phases"]) == {"replay", "optimize"} and m1["cached"] == ["export"]

    again = _states(grpo_step(run_dir, 1, return_state=True))  # nothing changed: everything comes back Cached
    assert set(again.values()) == {"Cached"}, again

    forced = _states(grpo_step(run_dir, 1, force_from="optimize", return_state=True))
    assert forced["replay-1"] == "Cached" and forced["optimize-1"] == "Completed", forced


def test_gate_failure_fails_the_task_without_retry(prefect_harness, tmp_path, monkeypatch):
    """A sampler that over-reports its log-probs by 3 nat (an injected defect) fails the rollout-parity gate."""
    from prefect.states import State

    from engine import runtime
    from flows.step import grpo_step

    real = runtime.Engine.answers

    def off_by_three(*args, **kwargs):
        ids, lps = real(*args, **kwargs)
        return ids, [[x + 3.0 for x in row] for row in lps]

    monkeypatch.setattr(runtime.Engine, "answers", off_by_three)  # the hf sampler role
    run_dir = make_run(tmp_path / "run")
    state: State = grpo_step(run_dir, 0, return_state=True)
    assert state.is_failed()
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    replay = [r for r in runs if r.name == "replay-0"]
    assert len(replay) == 1 and replay[0].state.name == "Failed"
    assert replay[0].run_count == 1, "GateFailed must not be retried"
    assert "rollout-parity" in replay[0].state.message
    assert not [r for r in runs if r.name.startswith("optimize")], "nothing after a failed gate may run"
    from artifacts import RunDir, read_json

    report = read_json(RunDir(tmp_path / "run").parity(0))
    assert report["passed"] is False and report["mean_gap"] == pytest.approx(3.0, abs=1e-3)
    # the gate report is attached as an artifact, and the diagnostic names the guilty path: every isolated path
    # agrees with the trainer; only the values the sampler recorded during the rollout are off
    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts()}
    assert {"step-0000-gate-rollout-parity", "step-0000-diagnostic"} <= keys, keys
    diag = read_json(RunDir(tmp_path / "run").step_dir(0) / "diagnostic-rollout-parity.json")
    assert diag["disagreeing_paths"] == ["sampler/rollout"], diag["disagreeing_paths"]
    assert diag["verdict"].startswith("sampler rollout path only")


def test_phase_times_split_prefill_from_latent_and_answers_where_the_stage_measured_it():
    from flows.step import phase_times

    graphed = {"stage": "generate-turn", "wall_s": 10.0, "latent_s": 4.0, "answers_s": 5.0,
               "latent_prefill_s": 1.5, "answers_prefill_s": 2.0}
    eager = {"stage": "generate-turn", "wall_s": 3.0, "latent_s": 1.0, "answers_s": 1.5}
    ph = phase_times([graphed, {"stage": "replay", "wall_s": 7.0}, {"stage": "optimize", "wall_s": 9.0, "cached": True}])
    assert ph == {"prefill": 3.5, "latent": 2.5, "answers": 3.0, "generate-other": 1.0, "replay": 7.0}
    assert sum(v for k, v in ph.items() if k != "replay") == graphed["wall_s"]  # the split adds up to the stage
    assert phase_times([eager]) == {"latent": 1.0, "answers": 1.5, "generate-other": 0.5}  # no prefill measured: none
